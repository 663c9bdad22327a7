"""Decode side of the push flow (SGLang's protocol): the prefill writes into our reserved blocks.

Steps, each bounded by the caller's deadline: resolve the prefill DP rank (disagg/rank_rule.py,
asking the registry when the rule says so), open (or reuse) the control stream to that rank, send
TransferInfo (room, destination blocks), wait for its verdict. SUCCESS carries the first token.
A request that ends first is fenced: its blocks stay quarantined until the prefill acknowledges the
abort of its room, or, when it does not in time, until that prefill is cut off.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from decode.peers import PrefillPeers
from decode.registries import Registry
from decode.waiting import Fences, PendingKV
from disagg.pd_config import DisaggConfig
from disagg.rank_rule import resolve_prefill_rank
from disagg.engine.core import EngineCore
from disagg.engine.progress import Reservation
from disagg.types import ErrorCode, InvalidRequest
from disagg.wire.auth import format_address
from disagg.wire.control_msgs import TransferInfoMsg, TransferStatusMsg
from disagg.wire.engine_msgs import GenerateMsg
from kvtransfer.base import PeerUnavailable
from kvtransfer.control.client import ControlClient

log = structlog.get_logger(__name__)
BOOTSTRAP_FIELDS = ("bootstrap_room", "bootstrap_host", "bootstrap_port")


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


def remote_prompt_ranks(msg: GenerateMsg, status: TransferStatusMsg) -> list[int | None] | None:
    """Their actual tokens' ranks (first entry None); None where a prefill sent none (an older one)."""
    if msg.sampling.prompt_logprobs is None or len(status.prompt_ranks) != len(status.prompt_logprobs):
        return None
    return [None, *status.prompt_ranks]


class PushFetch:
    def __init__(self, core: EngineCore, dp_rank: int, config: DisaggConfig, backend, peers: PrefillPeers, fences: Fences):
        self.core, self.dp_rank, self.config = core, dp_rank, config
        self.backend, self.peers, self.fences = backend, peers, fences

    def check(self, msg: GenerateMsg) -> None:
        """Refuse, before any connection, a request that cannot be served: a missing bootstrap field
        or a registry (host:port) the decode may not reach."""
        missing = [f for f in BOOTSTRAP_FIELDS if getattr(msg, f) is None]
        if missing:  # without a room, a request sent alone: a router may send it again with a prefill
            raise InvalidRequest(
                f"a decode request needs {', '.join(missing)}: disaggregated decode never re-computes the prompt "
                "locally (send it through a P/D router)", missing[0],
                ErrorCode.LOCAL_PREFILL_REFUSED if msg.bootstrap_room is None else None)
        if not self.config.decode.allows_bootstrap_address(msg.bootstrap_host, msg.bootstrap_port):
            address = format_address(msg.bootstrap_host, msg.bootstrap_port)
            raise InvalidRequest(f"bootstrap_host:bootstrap_port {address!r} is not allowed on this decode server "
                                 "(see its --allowed-bootstrap-hosts)", "bootstrap_host")

    async def fetch(self, pending: PendingKV, reservation: Reservation, deadline: float) -> TransferStatusMsg:
        msg = pending.msg
        host, port, room = msg.bootstrap_host, msg.bootstrap_port, msg.bootstrap_room
        remaining = lambda: max(deadline - time.monotonic(), 0.001)  # noqa: E731
        async with self.peers.registries.using(host, port) as registry:
            topology = await registry.topology(remaining())
            rank = resolve_prefill_rank(room, msg.disagg_prefill_dp_rank, dp_size=topology.dp_size,
                                        method=topology.load_balance_method,
                                        force_query=self.config.force_query_prefill_dp_rank)
            if rank is None:  # only the registry knows
                rank = await registry.client.wait_for_dp_rank(room, deadline_s=remaining())
            if msg.disagg_prefill_dp_rank is None and topology.dp_size > 1:  # the implied rank, or the registry's
                client = await self._implied_client(registry, room, rank, remaining)
            else:
                client = await self.peers.client(registry, rank, remaining())
        pending.client = client
        # Only the blocks after our own cached prefix: the prefill sends nothing into the ones we hold.
        info = TransferInfoMsg(room=room, peer_name=self.backend.agent_name, dst_block_ids=tuple(reservation.new_block_ids),
                               dst_dp_rank=self.dp_rank, num_prompt_tokens=reservation.num_prompt_tokens,
                               request_id=msg.request_id, num_cached_tokens=reservation.num_cached_tokens,
                               traceparent=msg.traceparent)
        pending.dst_block_ids = info.dst_block_ids
        return await client.send_transfer(info)

    async def _implied_client(self, registry: Registry, room: int, rank: int, remaining) -> ControlClient:
        """The stream to `rank`, unless the room lives elsewhere: while we (re)connect, the registry is
        asked for the room too (a prefill whose implied rank was down placed it on a live rank and
        registered it there). A live stream already open is used at once; a refusal (a secret, a
        layout) is answered at once; only an unreachable rank waits for the registry's word."""
        cached = self.peers.cached(registry.host, registry.port, rank)
        if cached is not None:
            return cached
        connect = asyncio.create_task(self.peers.client(registry, rank, remaining()))
        # Bounded so that an implied rank that cannot be reached and a room registered nowhere fail
        # within a connect timeout of each other, not at the request's deadline.
        asking_s = min(remaining(), 2 * self.config.control.connect_timeout_s)
        moved = asyncio.create_task(registry.client.wait_for_dp_rank(room, deadline_s=asking_s))
        pending = {connect, moved}
        try:
            while True:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                elsewhere = _elsewhere(moved, rank)
                if elsewhere is not None:
                    log.info("room placed off its implied prefill rank", bootstrap_room=room, implied=rank, dp_rank=elsewhere)
                    return await self.peers.client(registry, elsewhere, remaining())
                if connect.done() and (not isinstance(connect.exception(), PeerUnavailable) or moved.done()):
                    return connect.result()  # connected, refused, or unreachable with nowhere else to go
        finally:
            for task in (connect, moved):
                task.cancel()

    def admit(self, request_id: str, pending: PendingKV, status: TransferStatusMsg) -> bool:
        """The prompt's KV is in our blocks and the first token came with it: an ordinary running request."""
        return self.core.admit_remote_kv(request_id, status.first_token_id, first_token_logprobs(status),
                                         remote_prompt_logprobs(pending.msg, status), status.num_cached_tokens,
                                         remote_prompt_ranks(pending.msg, status))

    def end(self, request_id: str, pending: PendingKV, reason: str) -> bool:
        """Stop waiting; True when the blocks may go back now (the TransferInfo never went out, or
        the prefill already confirmed the room is final), else they are fenced."""
        if pending.client is None:
            return True
        fence = pending.client.abort(pending.room, reason)
        if fence.done() and fence.result():
            return True
        self.fences.start(request_id, self._await_fence(request_id, pending.client, fence))
        return False

    async def _await_fence(self, request_id: str, client, fence: asyncio.Future) -> None:
        try:
            acked = await asyncio.wait_for(asyncio.shield(fence), self.config.decode.abort_ack_timeout_s)
        except asyncio.TimeoutError:
            acked = False
            client.drop(f"no acknowledgement of an abort within {self.config.decode.abort_ack_timeout_s:g} s")
        if not acked and client.remote is not None:
            prefill = client.remote.peer_name
            if await asyncio.to_thread(self.backend.cut_inbound, prefill):
                log.warning("prefill cut off before reusing its blocks", prefill=prefill, request_id=request_id)
            else:  # NIXL: one-sided writes cannot be refused here; the prefill fences its own writes
                log.warning("prefill lost; its writes cannot be refused on this backend", prefill=prefill,
                            request_id=request_id, backend=self.config.transfer_backend)
        self.fences.fenced(request_id)


def _elsewhere(moved: asyncio.Task, rank: int) -> int | None:
    """The rank the registry named for the room, when it answered one other than `rank`."""
    if not moved.done() or moved.cancelled() or moved.exception() is not None:
        return None
    return None if moved.result() == rank else moved.result()
