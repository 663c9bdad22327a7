"""The decode worker: reserves blocks, asks the right prefill worker to fill them, then decodes.

Per request: resolve the prefill DP rank (DESIGN.md section 3), reserve blocks for the prompt,
send TransferInfo over the control stream, wait (bounded) for the prefill's status. SUCCESS turns
the request into an ordinary running one from its first token; FAILED, a lost prefill or the
deadline ends it with the reason. Abort at any point frees the reserved blocks and tells the prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import structlog

from decode.peers import PrefillPeers
from decode.pull import Ticket, check_engine, ticket_of, wait_read
from decode.resolver import QUERY, decide_prefill_dp_rank
from disagg.config import DisaggConfig
from disagg.dp.worker_role import WorkerRole, error_output, sampling_params
from disagg.engine.core import EngineCore
from disagg.types import FinishReason, InvalidRequest
from disagg.wire.control_msgs import TransferInfoMsg, TransferState, TransferStatusMsg
from disagg.wire.engine_msgs import GenerateMsg, KVStatsMsg, OutputMsg
from kvtransfer.base import PeerUnavailable, TransferFailed
from kvtransfer.control.endpoint import open_endpoint

log = structlog.get_logger(__name__)


@dataclass
class _Queued:
    msg: GenerateMsg
    prompt_ids: list[int]
    arrived: float


@dataclass
class _Pending:
    msg: GenerateMsg
    task: asyncio.Task
    started: float
    room: int
    client: object = None  # the ControlClient once the TransferInfo went out
    read: object = None  # pull flow: our READ of the prefill's blocks, while it runs
    read_peer: str = ""  # ... and the backend peer it reads from
    lease: tuple | None = None  # pull flow: (ControlClient, remote request id) once we may hold a lease


def first_token_logprobs(status: TransferStatusMsg) -> dict[int, float] | None:
    """The first token's logprobs as the engine keeps them (top-n plus the sampled token), if asked for."""
    if status.first_token_top_logprobs:
        return dict(status.first_token_top_logprobs)
    if status.first_token_logprob is not None:
        return {status.first_token_id: status.first_token_logprob}
    return None


def remote_prompt_logprobs(msg: GenerateMsg, status: TransferStatusMsg) -> list[dict[int, float] | None] | None:
    """The prompt logprobs the prefill computed, as the engine keeps them (first entry None), if asked for."""
    if msg.sampling.prompt_logprobs is None:
        return None
    return [None] + [dict(entry) for entry in status.prompt_logprobs]


class DecodeRole(WorkerRole):
    can_sleep = False

    def __init__(self, core: EngineCore, dp_rank: int, model_name: str, *, config: DisaggConfig):
        super().__init__(core, dp_rank, model_name)
        self.config = config
        self.control_config = config.control
        self.pending: dict[str, _Pending] = {}
        self.finished: list[tuple[str, TransferStatusMsg | Exception]] = []
        self.kv_stats: dict[str, KVStatsMsg] = {}  # attached to each admitted request's first output
        self.queued: deque[_Queued] = deque()  # waiting for room in the KV cache, in arrival order
        self.fencing: dict[str, asyncio.Task] = {}  # ended requests waiting for their prefill's fence
        self.fenced: list[str] = []  # ... whose blocks can go back to the pool now
        self._read_peers: dict[str, tuple] = {}  # pull flow: prefill agent -> (its ControlClient, backend peer)

    async def start(self) -> None:
        secret = self.config.cluster_secret
        self.backend, local = open_endpoint("decode", self.dp_rank, self.config.transfer_backend, self.config.rank_host,
                                            dataclasses.asdict(self.core.cache_spec()), secret)
        self.peers = PrefillPeers(local, self.control_config, secret)

    async def close(self) -> None:
        for task in [p.task for p in self.pending.values()] + list(self.fencing.values()):
            task.cancel()
        await self.peers.close()
        self.backend.close()

    async def submit(self, msg: GenerateMsg) -> list[OutputMsg]:
        try:
            ticket = ticket_of(msg)
            missing = [f for f in ("bootstrap_room", "bootstrap_host", "bootstrap_port") if getattr(msg, f) is None]
            if ticket is not None:
                missing = []
                if msg.sampling.prompt_logprobs is not None:
                    raise InvalidRequest("prompt logprobs are not available in the pull flow (kv_transfer_params): "
                                         "the decode reads the prompt's KV, not its logprobs", "prompt_logprobs")
                if not self.config.allows_bootstrap_host(ticket.host):
                    raise InvalidRequest(f"remote_host {ticket.host!r} is not allowed on this decode server "
                                         "(see its --allowed-bootstrap-hosts)", "kv_transfer_params")
            if missing:
                raise InvalidRequest(
                    f"a decode request needs {', '.join(missing)}: disaggregated decode never re-computes the prompt "
                    "locally (send it through a P/D router)", missing[0])
            if ticket is None and not self.config.allows_bootstrap_host(msg.bootstrap_host):
                # Refused before any connection: a request must not make the decode reach arbitrary hosts.
                raise InvalidRequest(f"bootstrap_host {msg.bootstrap_host!r} is not allowed on this decode server "
                                     "(see its --allowed-bootstrap-hosts)", "bootstrap_host")
            prompt_ids = self.prompt_ids(msg)
        except Exception as exc:
            return [error_output(msg.request_id, exc)]
        self.queued.append(_Queued(msg, prompt_ids, time.monotonic()))
        return self._reserve_queued()

    def _reserve_queued(self) -> list[OutputMsg]:
        """Reserve blocks for queued requests in arrival order while the cache has room; a request
        that waited past the deadline for room fails with 503."""
        out = []
        while self.queued:
            head = self.queued[0]
            try:
                blocks = self.core.reserve_for_remote_kv(head.msg.request_id, head.prompt_ids, sampling_params(head.msg.sampling))
            except Exception as exc:
                self.queued.popleft()
                out.append(error_output(head.msg.request_id, exc))
                continue
            if blocks is None:
                if time.monotonic() - head.arrived > self.config.waiting_timeout_s:
                    self.queued.popleft()
                    out.append(OutputMsg(head.msg.request_id, finish_reason=FinishReason.ABORT, error_status=503, error=(
                        f"the decode KV cache had no room for this prompt within {self.config.waiting_timeout_s:g} s")))
                    continue
                break
            self.queued.popleft()
            task = asyncio.create_task(self._fetch_kv(head.msg, blocks, len(head.prompt_ids)))
            self.pending[head.msg.request_id] = _Pending(head.msg, task, head.arrived, head.msg.bootstrap_room)
        return out

    async def _fetch_kv(self, msg: GenerateMsg, blocks: list[int], num_prompt_tokens: int) -> None:
        """Resolve, connect, send TransferInfo, wait for the prefill's verdict (all bounded)."""
        deadline = time.monotonic() + self.config.waiting_timeout_s
        try:
            transfer = self._transfer(msg, blocks, num_prompt_tokens, deadline)
            status = await asyncio.wait_for(transfer, self.config.waiting_timeout_s)
        except asyncio.TimeoutError:
            status = TransferStatusMsg(room=msg.bootstrap_room, state=TransferState.FAILED,
                                       reason=f"no KV from prefill within {self.config.waiting_timeout_s:g} s")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # bootstrap or control failures end this request only
            status = exc
        self.finished.append((msg.request_id, status))
        self.wake()

    async def _transfer(self, msg: GenerateMsg, blocks: list[int], num_prompt_tokens: int, deadline: float) -> TransferStatusMsg:
        ticket = ticket_of(msg)
        if ticket is not None:
            return await self._pull(msg.request_id, ticket, blocks, num_prompt_tokens, deadline)
        host, port, room = msg.bootstrap_host, msg.bootstrap_port, msg.bootstrap_room
        remaining = lambda: max(deadline - time.monotonic(), 0.001)  # noqa: E731
        topology = await self.peers.topology(host, port, remaining())
        rank = decide_prefill_dp_rank(room, msg.disagg_prefill_dp_rank, topology, self.config.force_query_prefill_dp_rank)
        if rank == QUERY:
            rank = await self.peers.bootstrap(host, port).wait_for_dp_rank(room, deadline_s=remaining())
        client = await self.peers.client(host, port, rank, remaining())
        self.pending[msg.request_id].client = client
        info = TransferInfoMsg(room=room, peer_name=self.backend.agent_name, dst_block_ids=tuple(blocks),
                               dst_dp_rank=self.dp_rank, num_prompt_tokens=num_prompt_tokens, request_id=msg.request_id)
        return await client.send_transfer(info)

    async def _pull(self, request_id: str, ticket: Ticket, blocks: list[int], num_prompt_tokens: int,
                    deadline: float) -> TransferStatusMsg:
        """Read the KV of every prompt token but the last from the ticket's prefill (decode/pull.py)."""
        client = await asyncio.wait_for(self.peers.client_at(ticket.host, ticket.port), max(deadline - time.monotonic(), 1e-3))
        check_engine(ticket, client.remote.peer_name)
        pending = self.pending[request_id]
        pending.lease = (client, ticket.request_id)
        prefill = await self._read_peer(client)
        claim = await client.claim(ticket.request_id)
        if not claim.ok:
            raise TransferFailed(f"prefill {ticket.host}:{ticket.port} refused the claim of {ticket.request_id}: {claim.reason}",
                                 peer_lost=claim.peer_lost)
        num_read = min(self.core.kv.blocks_needed(num_prompt_tokens - 1), len(claim.block_ids), len(blocks))
        num_bytes = 0
        if num_read:
            pending.read_peer = prefill
            pending.read = self.backend.read(prefill, blocks[:num_read], list(claim.block_ids[:num_read]),
                                             f"pull:{ticket.request_id}".encode())
            num_bytes = pending.read.num_bytes
            await wait_read(self.backend, pending.read, deadline)
            pending.read = None
        pending.lease = None
        released = await client.release(ticket.request_id)
        if not released.ok:
            raise TransferFailed(f"the KV of {ticket.request_id} was not held through the read: {released.reason}",
                                 peer_lost=released.peer_lost)
        return TransferStatusMsg(room=0, state=TransferState.SUCCESS, num_bytes=num_bytes)

    async def _read_peer(self, client) -> str:
        """The backend peer to READ from a prefill, added once per incarnation; peers of prefills whose
        stream is gone (lost, restarted under a new name) are removed first, so none piles up."""
        for name, (old, peer) in list(self._read_peers.items()):
            if not old.is_alive:
                del self._read_peers[name]
                await asyncio.to_thread(self.backend.remove_peer, peer)
        entry = self._read_peers.get(client.remote.peer_name)
        if entry is None:  # a tcp connect and handshake: off the loop
            peer = await asyncio.to_thread(self.backend.add_peer, client.remote.agent_metadata)
            entry = self._read_peers[client.remote.peer_name] = (client, peer)
        return entry[1]

    def idle_wait_s(self, default_s: float) -> float:
        return 0.002 if self.queued else default_s

    async def poll(self) -> list[OutputMsg]:
        self.backend.notifications()  # write tags: SUCCESS on the control stream is what counts
        out = self._reserve_queued()
        fenced, self.fenced = self.fenced, []
        for request_id in fenced:
            self.core.release(request_id)
        for request_id in [rid for rid in self.pending if self._ended(rid)]:
            # The engine failed it (and answered it): stop waiting, fence its blocks.
            self._end_pending(request_id, self.pending.pop(request_id), "the decode engine failed the request")
        finished, self.finished = self.finished, []
        for request_id, status in finished:
            pending = self.pending.pop(request_id, None)
            if pending is None:
                continue  # aborted meanwhile
            if isinstance(status, TransferStatusMsg) and status.state is TransferState.SUCCESS:
                if not self._admit(request_id, pending, status):
                    continue  # the engine ended the request meanwhile and already answered it
                wait_s = time.monotonic() - pending.started
                self.kv_stats[request_id] = KVStatsMsg(kv_bytes=status.num_bytes, kv_wait_s=wait_s)
                log.info("kv received", request_id=request_id, bootstrap_room=pending.room, kv_bytes=status.num_bytes,
                         wait_s=round(wait_s, 6))
            else:
                out += self._fail(request_id, pending, status)
        return out

    def _admit(self, request_id: str, pending: _Pending, status: TransferStatusMsg) -> bool:
        if status.first_token_id is None:  # pull flow: the last prompt token and the first output are ours
            progress = self.core.request_progress(request_id)
            return progress is not None and self.core.admit_remote_prefix(request_id, progress.num_prompt_tokens - 1)
        return self.core.admit_remote_kv(request_id, status.first_token_id, first_token_logprobs(status),
                                         remote_prompt_logprobs(pending.msg, status))

    def _ended(self, request_id: str) -> bool:
        progress = self.core.request_progress(request_id)
        return progress is None or progress.finished

    def step(self) -> list[OutputMsg]:
        return [self._with_kv_stats(msg) for msg in super().step()]

    def _with_kv_stats(self, msg: OutputMsg) -> OutputMsg:
        stats = self.kv_stats.pop(msg.request_id, None)
        return msg if stats is None else msgspec.structs.replace(msg, kv=stats)

    def _fail(self, request_id: str, pending: _Pending, status) -> list[OutputMsg]:
        if isinstance(status, TransferStatusMsg):
            reason = status.reason
        else:  # bad input reads as itself; anything else names its kind
            reason = status.message if isinstance(status, InvalidRequest) else f"{type(status).__name__}: {status}"
        unavailable = isinstance(status, PeerUnavailable) or getattr(status, "peer_lost", False)
        code = 400 if isinstance(status, InvalidRequest) else 503 if unavailable else 500
        log.warning("decode request failed", request_id=request_id, reason=reason)
        self.core.abort(request_id)
        self._end_pending(request_id, pending, reason)
        return [OutputMsg(request_id, finish_reason=FinishReason.ABORT, error=reason, error_status=code,
                          error_param=getattr(status, "param", None))]

    async def abort(self, request_id: str) -> list[OutputMsg]:
        for queued in self.queued:
            if queued.msg.request_id == request_id:
                self.queued.remove(queued)
                return [OutputMsg(request_id, finish_reason=FinishReason.ABORT)]
        pending = self.pending.pop(request_id, None)
        out = await super().abort(request_id)  # the engine ends it and quarantines its reserved blocks
        if pending is not None:
            self._end_pending(request_id, pending, "aborted on the decode side")
        return out

    def _end_pending(self, request_id: str, pending: _Pending, reason: str) -> None:
        """Stop waiting for a request's KV. The engine keeps its blocks quarantined; they are released
        once no write of its prefill can land: at once when the TransferInfo never went out, else
        when the prefill confirms the room is final, or after that prefill is cut off."""
        pending.task.cancel()
        self.kv_stats.pop(request_id, None)
        if pending.read is not None:  # pull flow: our own read is what writes into the blocks
            self.backend.abort(pending.read, reason)
            key = f"read:{request_id}"
            self.fencing[key] = asyncio.create_task(self._cut_read(key, request_id, pending.read_peer))
        if pending.lease is not None:  # pull flow: the prefill frees its blocks now, not at expiry
            client, remote_request_id = pending.lease
            client.release(remote_request_id, reason)
        elif (ticket := ticket_of(pending.msg)) is not None:  # gave up before reaching the prefill
            key = f"release:{request_id}"
            self.fencing[key] = asyncio.create_task(self._release_ticket(key, ticket, reason))
        if pending.read is not None:
            return  # released once the read is cut off (_cut_read)
        if pending.client is None:
            self.core.release(request_id)
            return
        fence = pending.client.abort(pending.room, reason)
        if fence.done() and fence.result():
            self.core.release(request_id)
            return
        self.fencing[request_id] = asyncio.create_task(self._await_fence(request_id, pending.client, fence))

    async def _cut_read(self, key: str, request_id: str, peer: str) -> None:
        """An aborted READ may be mid-copy (cancelling is best effort): drop that prefill's backend
        peer (tcp: close its connection and join its threads) before the blocks go back. Other reads
        from that prefill fail with it; the next one adds the peer again."""
        try:
            for name, (_, known) in list(self._read_peers.items()):
                if known == peer:
                    del self._read_peers[name]
            await asyncio.to_thread(self.backend.remove_peer, peer)
        finally:
            self.fencing.pop(key, None)
            self.fenced.append(request_id)
            self.wake()

    async def _release_ticket(self, key: str, ticket: Ticket, reason: str) -> None:
        """Pull flow: tell a ticket's prefill to free the blocks we will not read (bounded)."""
        try:
            client = await asyncio.wait_for(self.peers.client_at(ticket.host, ticket.port), self.config.waiting_timeout_s)
            await asyncio.wait_for(client.release(ticket.request_id, reason), self.config.waiting_timeout_s)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own then
            log.warning("could not release a ticket's lease", request_id=ticket.request_id, error=str(exc))
        finally:
            self.fencing.pop(key, None)

    async def _await_fence(self, request_id: str, client, fence: asyncio.Future) -> None:
        try:
            acked = await asyncio.wait_for(asyncio.shield(fence), self.config.abort_ack_timeout_s)
        except asyncio.TimeoutError:
            acked = False
            client.drop(f"no acknowledgement of an abort within {self.config.abort_ack_timeout_s:g} s")
        if not acked and client.remote is not None:
            prefill = client.remote.peer_name
            if await asyncio.to_thread(self.backend.cut_inbound, prefill):
                log.warning("prefill cut off before reusing its blocks", prefill=prefill, request_id=request_id)
            else:  # NIXL: one-sided writes cannot be refused here; the prefill fences its own writes
                log.warning("prefill lost; its writes cannot be refused on this backend", prefill=prefill,
                            request_id=request_id, backend=self.config.transfer_backend)
        self.fencing.pop(request_id, None)
        self.fenced.append(request_id)
        self.wake()
