"""The prefill worker: computes prompts and writes their KV into the decode's reserved blocks.

Per request (keyed by bootstrap_room): the engine computes the prompt with `hold_blocks`; blocks go
out as soon as they are computed and the decode's destination is known (so chunked prompts stream);
once every block landed, the decode gets SUCCESS with the first token, the blocks are released and
the 1-token HTTP answer goes back. Every wait has a deadline; a failure answers both sides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import structlog

from bootstrap.client import BootstrapClient
from disagg.config import DisaggConfig, LoadBalanceMethod
from disagg.dp.worker_role import WorkerRole, error_output, sampling_params
from disagg.engine.core import EngineCore
from disagg.types import FinishReason, InvalidRequest
from disagg.wire.bootstrap_msgs import RankRegistrationMsg
from disagg.wire.control_msgs import (
    AbortMsg, LeaseMsg, PeerLostMsg, PeerMsg, TransferInfoMsg, TransferState, TransferStatusMsg,
)
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg, RoomMisroutedMsg
from kvtransfer import KVTransferError
from kvtransfer.control.endpoint import open_endpoint
from kvtransfer.control.server import ControlServer
from prefill.pull import PullRequests, is_pull
from prefill.rooms import PrefillRoom, RoomTable, Settling

log = structlog.get_logger(__name__)
BUSY_WAIT_S = 0.002


class PrefillRole(WorkerRole):
    can_sleep = False

    def __init__(self, core: EngineCore, dp_rank: int, model_name: str, *, config: DisaggConfig, dp_size: int,
                 load_balance_method: LoadBalanceMethod):
        super().__init__(core, dp_rank, model_name)
        self.config = config
        self.dp_size = dp_size
        self.load_balance_method = load_balance_method
        self.control_config = config.control
        self.rooms: dict[int, PrefillRoom] = {}
        self.by_request: dict[str, int] = {}
        ttl_s = config.bootstrap_timeout_s
        self.early_infos = RoomTable(ttl_s)  # room -> (TransferInfo that came before the request, expiry)
        self.failed_rooms = RoomTable(ttl_s)  # room -> (why it failed, expiry)
        self.elsewhere = RoomTable(ttl_s)  # rooms the front placed on another rank: rank, expiry
        self.served = RoomTable(ttl_s)  # rooms whose KV went out: a second decode for one is refused at once
        self.peers: dict[str, str] = {}  # decode peer name -> backend peer name
        self.settling: list[Settling] = []  # failed rooms whose posted writes have not all ended yet
        self.peer_failures: dict[str, str] = {}  # decode peer name -> why add_peer failed
        self.pull = PullRequests(core, config.kv_lease_s)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        secret = self.config.cluster_secret
        self.backend, local = open_endpoint("prefill", self.dp_rank, self.config.transfer_backend, self.config.rank_host,
                                            dataclasses.asdict(self.core.cache_spec()), secret)
        # A control event (a claim, a release, a TransferInfo) ends the worker's idle wait at once.
        self.control = ControlServer(local, self.control_config, cluster_secret=secret, on_event=lambda: self.wake())
        port = await self.control.start(self.config.rank_host, 0)
        self.bootstrap = BootstrapClient(self.config.bootstrap_host, self.config.bootstrap_port, cluster_secret=secret)
        self.registration = RankRegistrationMsg(
            dp_rank=self.dp_rank, dp_size=self.dp_size, rank_ip=self.config.rank_host, rank_port=port,
            page_size=local.layout.block_size_tokens, kv_cache_dtype=local.layout.dtype, load_balance_method=self.load_balance_method,
            transfer_backend=self.config.transfer_backend, agent_name=self.backend.agent_name,
        )
        await self.bootstrap.register_rank(self.registration)
        # Pull flow: what a decode needs to reach this worker and read from it (vLLM's field names).
        self.ticket = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.backend.agent_name,
                       "remote_host": self.config.rank_host, "remote_port": port, "tp_size": 1}
        self.refresher = asyncio.create_task(self._refresh_registration())
        log.info("prefill rank registered", control_port=port, backend=self.config.transfer_backend)

    async def _refresh_registration(self) -> None:
        """Register again every `registry_refresh_s`: a registry that restarted (and forgot the
        ranks) knows the topology again within that period."""
        interval_s = self.config.registry_refresh_s
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.bootstrap.register_rank(self.registration, deadline_s=interval_s)
            except Exception as exc:  # noqa: BLE001 - the registry may be down for a while: try again later
                log.warning("registry refresh failed", error=f"{type(exc).__name__}: {exc}")

    async def close(self) -> None:
        self.refresher.cancel()
        await self.control.close()
        await self.bootstrap.close()
        self.backend.close()

    def utility(self, method: str, args: list) -> object:
        result = super().utility(method, args)
        if method == "stats":  # a drain waits for the tickets it issued (PrefillController.settle)
            result = dict(result, num_leases=len(self.pull.leases.leases))
        return result

    def idle_wait_s(self, default_s: float) -> float:
        return BUSY_WAIT_S if self.rooms or self.early_infos else default_s

    # ---- requests -----------------------------------------------------------------------------

    async def submit(self, msg: GenerateMsg) -> list[OutputMsg]:
        room = msg.bootstrap_room
        try:
            if is_pull(msg):
                self.core.add_request(msg.request_id, self.prompt_ids(msg), self._one_token(msg), hold_blocks=True)
                self.pull.track(msg.request_id)
                return []
            if room is None:
                raise InvalidRequest("a prefill request needs bootstrap_room (and bootstrap_host, bootstrap_port)", "bootstrap_room")
            if room in self.rooms:
                raise InvalidRequest(f"bootstrap_room {room} is already in use on this prefill worker", "bootstrap_room")
            self.core.add_request(msg.request_id, self.prompt_ids(msg), self._one_token(msg), hold_blocks=True)
        except Exception as exc:
            if room is not None and room not in self.rooms:  # a duplicate never spoils the room in use
                await self.room_failed(room, f"the prefill rejected the request: {exc}")
            return [error_output(msg.request_id, exc)]
        self.failed_rooms.pop(room, None)  # a room dispatched here now is served here (a router's retry)
        self.elsewhere.pop(room, None)
        self.served.pop(room, None)
        self.rooms[room] = PrefillRoom(room, msg.request_id, time.monotonic() + self.config.bootstrap_timeout_s)
        self.by_request[msg.request_id] = room
        if room in self.early_infos:
            self._attach(self.early_infos.pop(room)[0])
        if msg.register_room:
            await self.bootstrap.register_dp_rank(room, self.dp_rank)
        return []

    @staticmethod
    def _one_token(msg: GenerateMsg):
        params = sampling_params(msg.sampling)
        # The first token obeys min_tokens as it would in one engine (no EOS or stop id first).
        return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))

    async def abort(self, request_id: str) -> list[OutputMsg]:
        if self.pull.abort(request_id):
            return self._convert(self.core.take_outputs())
        room = self.by_request.get(request_id)
        if room is not None:
            return self._fail(self.rooms[room], "aborted on the prefill side", status=499)
        return await super().abort(request_id)

    async def room_failed(self, room: int, reason: str, decode: str = "") -> list[OutputMsg]:
        held = self.rooms[room].info if room in self.rooms else self.early_infos.get(room, (None,))[0]
        if decode and held is not None and decode_of(held) != decode:
            # A stray duplicate asked the wrong rank; the room's own decode is here and is served.
            log.info("room kept: another decode was misrouted", bootstrap_room=room, decode=decode, reason=reason)
            return []
        if room in self.rooms:  # its decode went to another rank: no destination will come here
            return self._fail(self.rooms[room], reason)
        self.failed_rooms.put(room, reason)
        if room in self.early_infos:
            self.early_infos.pop(room)
            self._status(room, TransferState.FAILED, reason)
        return []

    def room_placed(self, room: int, dp_rank: int) -> list:
        self.failed_rooms.pop(room, None)  # an earlier verdict on this room is superseded by its new dispatch
        self.elsewhere.put(room, dp_rank)
        if room in self.early_infos:  # the decode came here before the front placed the room
            return self._misrouted(self.early_infos.pop(room)[0])
        return []

    def _misrouted(self, info: TransferInfoMsg) -> list:
        """Answer a decode that asked this rank for a room another rank holds; the front then fails
        the room there too (RoomMisroutedMsg), so neither side waits for its deadline."""
        room = info.room
        reason = (f"bootstrap_room {room} was dispatched to prefill DP rank {self.elsewhere[room][0]}, but the decode "
                  f"asked prefill DP rank {self.dp_rank} for its KV: disagg_prefill_dp_rank must name the rank the "
                  "prefill request went to")
        log.warning("misrouted decode", bootstrap_room=room, reason=reason)
        self._status(room, TransferState.FAILED, reason)
        return [RoomMisroutedMsg(room, reason, decode_of(info))]

    def _convert(self, outputs) -> list[OutputMsg]:
        """Answers of P/D requests are held until their KV is delivered; a request the engine
        failed fails its room in the next poll (this may run in the engine-step thread)."""
        out = []
        for msg in super()._convert(outputs):
            if self.pull.hold(msg):
                continue
            room = self.by_request.get(msg.request_id)
            if room is None:
                out.append(msg)
                continue
            state = self.rooms[room]
            if msg.error is not None:
                state.error = msg.error
            elif msg.new_token_ids:
                state.first_token = (msg.new_token_ids[0], tuple(msg.logprobs[0]) if msg.logprobs else ())
            if msg.prompt_logprobs is not None:  # the decode answers with them (the first token has none)
                state.prompt_logprobs = tuple(tuple(map(tuple, e)) for e in msg.prompt_logprobs[1:] if e is not None)
            if msg.finish_reason is not None:
                state.final = msg
                state.computed_at = time.monotonic()
        return out

    # ---- background: control events and transfers --------------------------------------------

    async def poll(self) -> list[OutputMsg]:
        out: list[OutputMsg] = []
        self.backend.notifications()  # push flow tracks completion by handle: drop tags, never let them pile up
        while not self.control.events.empty():
            event = self.control.events.get_nowait()
            if isinstance(event, PeerMsg):
                await self._add_peer(event)
            else:
                out += self._on_event(event)
        now = time.monotonic()
        for state in list(self.rooms.values()):
            out += self._advance(state, now)
        self._settle(now)
        self._expire(now)
        return out + self.pull.answer(now, self.ticket)

    def _on_event(self, event) -> list[OutputMsg]:
        if isinstance(event, TransferInfoMsg):
            return self._on_transfer_info(event)
        if isinstance(event, AbortMsg):
            # Every abort is answered with a final status once nothing can be written any more:
            # the decode keeps the room's blocks quarantined until then.
            state = self.rooms.get(event.room)
            reason = f"aborted by decode: {event.reason}"
            if state is not None:
                return self._fail(state, reason, status=499)
            self.early_infos.pop(event.room, None)
            if not any(entry.room == event.room for entry in self.settling):  # else _settle answers, once settled
                self._status(event.room, TransferState.FAILED, reason)  # never written to
        elif isinstance(event, LeaseMsg):
            self.control.send_lease(event.peer_name, self.pull.on_lease(event))
        elif isinstance(event, PeerLostMsg):
            self.pull.on_peer_lost(event.peer_name)
            self.peer_failures.pop(event.peer_name, None)
            out = []
            for room in event.rooms:
                if room in self.rooms:
                    out += self._fail(self.rooms[room], f"lost decode {event.peer_name}: {event.reason}", tell_decode=False)
            backend_peer = self.peers.pop(event.peer_name, None)
            if backend_peer is not None:  # no stale metadata: a returning decode registers anew
                self.backend.remove_peer(backend_peer)
            return out
        return []

    async def _add_peer(self, peer: PeerMsg) -> None:
        """Load a registered decode's transfer metadata. A decode we cannot reach (or that refuses our
        cluster secret) fails its own rooms with the reason; it never takes this worker down."""
        try:
            # A tcp connect and handshake: off the loop, so control streams keep moving meanwhile.
            self.peers[peer.peer_name] = await asyncio.to_thread(self.backend.add_peer, peer.agent_metadata)
            self.peer_failures.pop(peer.peer_name, None)
        except KVTransferError as exc:
            log.warning("decode peer not added", peer=peer.peer_name, reason=str(exc))
            self.peers.pop(peer.peer_name, None)
            self.peer_failures[peer.peer_name] = str(exc)

    def _on_transfer_info(self, info: TransferInfoMsg) -> list:
        if info.room in self.failed_rooms:
            self._status(info.room, TransferState.FAILED, self.failed_rooms[info.room][0])
        elif info.room in self.rooms:
            self._attach(info)
        elif info.room in self.elsewhere:
            return self._misrouted(info)
        elif info.room in self.served:  # its KV went to another decode already: no prefill will come for this one
            self._status(info.room, TransferState.FAILED, f"bootstrap_room {info.room} was already served on this prefill worker")
        else:
            self.early_infos.put(info.room, info)
        return []

    def _attach(self, info: TransferInfoMsg) -> None:
        state = self.rooms[info.room]
        state.info, state.peer, state.info_at = info, self.peers.get(info.peer_name), time.monotonic()

    def _advance(self, state: PrefillRoom, now: float) -> list[OutputMsg]:
        if state.error is not None:
            return self._fail(state, state.error)
        if state.info is None:
            if now > state.deadline:
                return self._fail(state, f"no destination from decode for bootstrap_room {state.room} "
                                         f"within {self.config.bootstrap_timeout_s:g} s", status=504)
            return []
        if now > state.info_at + self.config.transfer_timeout_s:
            return self._fail(state, f"the KV of bootstrap_room {state.room} did not reach decode "
                                     f"{state.info.peer_name} within {self.config.transfer_timeout_s:g} s", status=504)
        if state.peer is None:
            failure = self.peer_failures.get(state.info.peer_name)
            if failure is not None:
                return self._fail(state, f"decode peer {state.info.peer_name} could not be added: {failure}")
            return self._fail(state, f"decode peer {state.info.peer_name} never registered")
        progress = self.core.request_progress(state.request_id)
        if progress is not None and self.control.is_writable(state.room):  # never after an abort or a lost stream
            self._send_ready_blocks(state, progress)
        statuses = [self.backend.poll(handle) for handle in state.handles]
        failed = next((s for s in statuses if s.state is TransferState.FAILED), None)
        if failed is not None:
            return self._fail(state, f"KV transfer failed: {failed.reason}")
        done = all(s.state is TransferState.SUCCESS for s in statuses)
        if state.final is not None and state.all_sent and done:
            return self._succeed(state)
        return []

    def _send_ready_blocks(self, state: PrefillRoom, progress) -> None:
        ready = state.blocks_ready(progress.block_ids, progress.num_computed_tokens, self.core.block_size, progress.finished)
        ready = min(ready, len(state.info.dst_block_ids))
        if ready > state.num_sent_blocks:
            first = state.num_sent_blocks
            handle = self.backend.write(state.peer, progress.block_ids[first:ready], list(state.info.dst_block_ids[first:ready]),
                                        f"room:{state.room}:{ready}".encode())
            state.handles.append(handle)
            state.num_bytes += handle.num_bytes
            state.num_sent_blocks = ready

    def _succeed(self, state: PrefillRoom) -> list[OutputMsg]:
        token_id, top = state.first_token  # top: (id, logprob) pairs, the sampled token first
        self.control.send_status(TransferStatusMsg(
            room=state.room, state=TransferState.SUCCESS, first_token_id=token_id, num_bytes=state.num_bytes,
            first_token_logprob=top[0][1] if top else None, first_token_top_logprobs=top,
            prompt_logprobs=state.prompt_logprobs))
        stats = state.stats(time.monotonic())
        log.info("kv transferred", bootstrap_room=state.room, request_id=state.request_id, kv_bytes=stats.kv_bytes,
                 bootstrap_wait_s=round(stats.bootstrap_wait_s, 6), prefill_compute_s=round(stats.prefill_compute_s, 6),
                 transfer_s=round(stats.transfer_s, 6), gb_per_s=round(stats.kv_bytes / max(stats.transfer_s, 1e-9) / 1e9, 3))
        self._forget(state)
        self.served.put(state.room, state.request_id)
        return [msgspec.structs.replace(state.final, kv=stats)]

    def _fail(self, state: PrefillRoom, reason: str, status: int = 500, tell_decode: bool = True) -> list[OutputMsg]:
        """End a room: no write is posted for it any more, the client hears at once. The decode's
        FAILED status waits until every posted write settled (it is the decode's fence)."""
        log.warning("prefill request failed", bootstrap_room=state.room, request_id=state.request_id, reason=reason)
        # A decode that asks about this room later is answered at once, not after its deadline.
        self.failed_rooms.put(state.room, reason)
        self.rooms.pop(state.room, None)
        self.by_request.pop(state.request_id, None)
        # Our source blocks may go back at once: a write still reading them only lands in
        # destination blocks the decode keeps quarantined until our final status.
        self.core.abort(state.request_id)
        if tell_decode and state.handles:
            self.settling.append(Settling(state.room, state.info.peer_name, tuple(state.handles), reason,
                                          time.monotonic() + self.config.transfer_timeout_s))
        else:
            for handle in state.handles:
                self.backend.release(handle)
            if tell_decode:
                self._status(state.room, TransferState.FAILED, reason)
        return [OutputMsg(state.request_id, finish_reason=FinishReason.ABORT, error=reason, error_status=status)]

    def _settle(self, now: float) -> None:
        """Send a failed room's final status once its posted writes all ended; a transport stuck past
        `transfer_timeout_s` gets that decode's stream dropped (it then cuts us off itself)."""
        for entry in list(self.settling):
            if all(self.backend.poll(h).state.is_terminal for h in entry.handles):
                self._status(entry.room, TransferState.FAILED, entry.reason)
            elif now > entry.deadline:
                self.control.drop_peer(entry.peer_name, f"writes of bootstrap_room {entry.room} did not settle "
                                                        f"within {self.config.transfer_timeout_s:g} s")
            else:
                continue
            for handle in entry.handles:
                self.backend.release(handle)
            self.settling.remove(entry)

    def _forget(self, state: PrefillRoom) -> None:
        for handle in state.handles:
            self.backend.release(handle)
        self.rooms.pop(state.room, None)
        self.by_request.pop(state.request_id, None)
        self.core.release(state.request_id)

    def _status(self, room: int, state: TransferState, reason: str) -> None:
        self.control.send_status(TransferStatusMsg(room=room, state=state, reason=reason))

    def _expire(self, now: float) -> None:
        for room, _ in self.early_infos.pop_expired(now):
            self._status(room, TransferState.FAILED, f"no prefill request for bootstrap_room {room} arrived here")
        self.failed_rooms.pop_expired(now)
        self.elsewhere.pop_expired(now)
        self.served.pop_expired(now)


def decode_of(info: TransferInfoMsg) -> str:
    """Which decode request a TransferInfo came from: "peer_name/request_id"."""
    return f"{info.peer_name}/{info.request_id}"
