"""Prefill side of the push flow (SGLang's protocol): a room's whole life on this worker.

A request arrives with its `bootstrap_room`; the decode's TransferInfo (its destination blocks) may
come before or after it. The engine computes the prompt with `hold_blocks`; blocks are written into
the decode's as soon as they are computed and the destination is known (chunked prompts stream);
once every block landed, the decode hears SUCCESS with the first token, the blocks are released and
the 1-token answer goes to the front. A room that fails tells its decode FAILED only once every
posted write ended (the decode's fence). Every wait has a deadline. Rooms the front placed on
another rank, rooms already served and rooms that failed answer a late decode at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import structlog

from disagg.pd_config import DisaggConfig
from disagg.worker.outputs import error_output, logprob_pairs
from disagg.engine.core import EngineCore
from disagg.types import ErrorCode, FinishReason, InvalidRequest, RequestOutput
from disagg.wire.control_msgs import PeerMsg, TransferInfoMsg, TransferState, TransferStatusMsg
from disagg.wire.engine_msgs import DecodeKey, GenerateMsg, OutputMsg, RoomMisroutedMsg
from kvtransfer import KVTransferError
from kvtransfer.checksum import KVDigest, piece_tag, pieces
from kvtransfer.control.server import ControlServer
from prefill.rooms import RUNNING, PrefillRoom, RoomBook, RoomState, Settling

log = structlog.get_logger(__name__)


def decode_of(info: TransferInfoMsg) -> DecodeKey:
    """Which decode request a TransferInfo came from."""
    return DecodeKey(info.peer_name, info.request_id)


class PushRooms:
    """Every push room of one prefill worker, keyed by bootstrap_room."""

    def __init__(self, core: EngineCore, dp_rank: int, config: DisaggConfig, backend, control: ControlServer,
                 register_room: Callable):
        self.core, self.dp_rank, self.config = core, dp_rank, config
        self.backend, self.control = backend, control
        self.register_room = register_room  # async (room, dp_rank): tell the registry this rank holds it
        self.book = RoomBook(config.prefill.bootstrap_timeout_s)  # every room, in one state (prefill/rooms.py)
        self.num_failed = [0, 0]  # rooms failed so far: [bootstrap (no destination, decode not reached), transfer]
        self.peers: dict[str, str] = {}  # decode peer name -> backend peer name
        self.settling: list[Settling] = []  # failed rooms whose posted writes have not all ended yet
        self.peer_failures: dict[str, str] = {}  # decode peer name -> why add_peer failed

    @property
    def busy(self) -> bool:
        """A room is moving: the worker polls at once instead of idling."""
        return bool(self.book.running or self.book.num_early)

    # ---- requests ------------------------------------------------------------------------------

    async def submit(self, msg: GenerateMsg, prompt_ids: Callable[[GenerateMsg], list[int]], params) -> list[OutputMsg]:
        room = msg.bootstrap_room
        try:
            if room is None:
                raise InvalidRequest("a prefill request needs bootstrap_room (and bootstrap_host, bootstrap_port)", "bootstrap_room")
            if room in self.book.running:
                raise InvalidRequest(f"bootstrap_room {room} is already in use on this prefill worker", "bootstrap_room")
            self.core.add_request(msg.request_id, prompt_ids(msg), params, hold_blocks=True, priority=msg.priority)
        except Exception as exc:
            if room is not None and room not in self.book.running:  # a duplicate never spoils the room in use
                await self.room_failed(room, f"the prefill rejected the request: {exc}")
            return [error_output(msg.request_id, exc)]
        # A room dispatched here now is served here, whatever was said of it before (a router's retry).
        early = self.book.verdict(room) if self.book.state_of(room) is RoomState.EARLY else None
        self.book.start(PrefillRoom(room, msg.request_id, time.monotonic() + self.config.prefill.bootstrap_timeout_s,
                                    self.core.block_size))
        if early is not None:
            self._attach(early)
        if msg.register_room:
            return await self._register(room)
        return []

    async def _register(self, room: int) -> list[OutputMsg]:
        """Tell the registry this rank holds `room`; a registry that is down or full fails the room
        at once (503), its blocks freed, instead of leaving it to wait for a decode that cannot find it."""
        try:
            await self.register_room(room, self.dp_rank)
        except Exception as exc:  # noqa: BLE001 - one room's registration never stops the worker
            if room not in self.book.running:
                return []  # ended meanwhile (aborted): already answered
            reason = f"the bootstrap registry did not take bootstrap_room {room}: {type(exc).__name__}: {exc}"
            return self._fail(self.book.running[room], reason, status=503)
        return []

    def abort(self, request_id: str) -> list[OutputMsg] | None:
        """Abort a push request on the prefill side; None when it is not one."""
        room = self.book.by_request.get(request_id)
        return None if room is None else self._fail(self.book.running[room], "aborted on the prefill side", status=499)

    def take(self, out: RequestOutput, msg: OutputMsg) -> bool:
        """Hold a push request's answer until its KV is delivered, taking the first token (and the
        prompt logprobs) from the engine's output; False when it is not one. It may run in the
        engine-step thread: a request the engine failed fails its room in the next poll."""
        room = self.book.by_request.get(out.request_id)
        if room is None:
            return False
        state = self.book.running[room]
        if out.error is not None:
            state.error = out.error
        elif out.new_token_ids:
            token_id = out.new_token_ids[0]
            logprobs = out.outputs.logprobs
            top = () if logprobs is None else logprob_pairs(
                logprobs[len(logprobs) - len(out.new_token_ids)], token_id, out.num_logprobs or 0, out.logprob_token_ids)
            state.first_token = (token_id, tuple(top))
        if out.prompt_logprobs is not None and not state.prompt_logprobs:  # the decode answers with them
            ranks = out.prompt_ranks or [None] * len(out.prompt_logprobs)
            entries = [(tuple(logprob_pairs(top, token_id, out.num_prompt_logprobs or 0, out.logprob_token_ids)), rank)
                       for top, token_id, rank in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], ranks[1:])
                       if top is not None]
            state.prompt_logprobs = tuple(pairs for pairs, _ in entries)
            # every rank or none (the decode then gives none: vLLM's `rank` is null where unknown)
            state.prompt_ranks = () if any(r is None for _, r in entries) else tuple(r for _, r in entries)
        if out.finished:
            state.final = msg
            state.computed_at = time.monotonic()
        return True

    # ---- what the front and the control plane say ----------------------------------------------

    async def room_failed(self, room: int, reason: str, decode: DecodeKey | None = None) -> list[OutputMsg]:
        was = self.book.state_of(room)
        held = self.book.running[room].info if was in RUNNING else self.book.verdict(room) if was is RoomState.EARLY else None
        if decode is not None and held is not None and decode_of(held) != decode:
            # A stray duplicate asked the wrong rank; the room's own decode is here and is served.
            log.info("room kept: another decode was misrouted", bootstrap_room=room, decode=decode, reason=reason)
            return []
        if was in RUNNING:  # its decode went to another rank: no destination will come here
            return self._fail(self.book.running[room], reason)
        self.book.settle(room, RoomState.FAILED, reason)
        if was is RoomState.EARLY:
            self._status(room, TransferState.FAILED, reason)
        return []

    def room_placed(self, room: int, dp_rank: int) -> list:
        """An earlier verdict on this room is superseded by its new dispatch (a room running here stays)."""
        was = self.book.state_of(room)
        if was in RUNNING:
            return []
        early = self.book.verdict(room) if was is RoomState.EARLY else None
        self.book.settle(room, RoomState.ELSEWHERE, dp_rank)
        if early is not None:  # the decode came here before the front placed the room
            return self._misrouted(early)
        return []

    def _misrouted(self, info: TransferInfoMsg) -> list:
        """Answer a decode that asked this rank for a room another rank holds; the front then fails
        the room there too (RoomMisroutedMsg), so neither side waits for its deadline."""
        room = info.room
        reason = (f"bootstrap_room {room} was dispatched to prefill DP rank {self.book.verdict(room)}, but the decode "
                  f"asked prefill DP rank {self.dp_rank} for its KV: disagg_prefill_dp_rank must name the rank the "
                  "prefill request went to")
        log.warning("misrouted decode", bootstrap_room=room, reason=reason)
        self._status(room, TransferState.FAILED, reason)
        return [RoomMisroutedMsg(room, reason, decode_of(info))]

    def on_transfer_info(self, info: TransferInfoMsg) -> list:
        was = self.book.state_of(info.room)
        if was is RoomState.FAILED:
            self._status(info.room, TransferState.FAILED, self.book.verdict(info.room))
        elif was in RUNNING:
            self._attach(info)
        elif was is RoomState.ELSEWHERE:
            return self._misrouted(info)
        elif was is RoomState.SERVED:  # its KV went to another decode already: no prefill will come for this one
            self._status(info.room, TransferState.FAILED, f"bootstrap_room {info.room} was already served on this prefill worker")
        else:
            self.book.settle(info.room, RoomState.EARLY, info)
        return []

    def on_decode_abort(self, room: int, reason: str) -> list[OutputMsg]:
        """Every abort is answered with a final status once nothing can be written any more: the
        decode keeps the room's blocks quarantined until then."""
        reason = f"aborted by decode: {reason}"
        state = self.book.running.get(room)
        if state is not None:
            return self._fail(state, reason, status=499, code=ErrorCode.ABORTED_BY_DECODE)
        if self.book.state_of(room) is RoomState.EARLY:
            self.book.forget(room)
        if not any(entry.room == room for entry in self.settling):  # else settle() answers, once settled
            self._status(room, TransferState.FAILED, reason)  # never written to
        return []

    def on_peer_lost(self, peer_name: str, rooms, reason: str) -> list[OutputMsg]:
        self.peer_failures.pop(peer_name, None)
        out = []
        for room in rooms:
            if room in self.book.running:
                out += self._fail(self.book.running[room], f"lost decode {peer_name}: {reason}", tell_decode=False)
        backend_peer = self.peers.pop(peer_name, None)
        if backend_peer is not None:  # no stale metadata: a returning decode registers anew
            self.backend.remove_peer(backend_peer)
        return out

    async def add_peer(self, peer: PeerMsg) -> None:
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

    def _attach(self, info: TransferInfoMsg) -> None:
        state = self.book.attach(info.room)
        state.info, state.peer, state.info_at = info, self.peers.get(info.peer_name), time.monotonic()
        state.num_sent_blocks = state.num_skipped_blocks  # the decode's own prefix: nothing to send
        state.digest = None  # --kv-checksum: a room sent again is digested again from its first block

    # ---- progress ------------------------------------------------------------------------------

    def advance(self, now: float) -> list[OutputMsg]:
        """Move every room one step (blocks out, transfers polled, deadlines checked), then settle
        failed rooms and forget expired verdicts."""
        out: list[OutputMsg] = []
        for state in list(self.book.running.values()):
            out += self._advance(state, now)
        self._settle(now)
        self._expire(now)
        return out

    def _advance(self, state: PrefillRoom, now: float) -> list[OutputMsg]:
        failure = self._check(state, now)
        if failure is not None:
            reason, status = failure
            return self._fail(state, reason, status=status)
        if state.info is None:
            return []
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

    def _check(self, state: PrefillRoom, now: float) -> tuple[str, int] | None:
        """Why the room must fail now (and the client's status), if it must."""
        if state.error is not None:
            return state.error, 500
        if state.info is None:
            if now > state.deadline:
                return (f"no destination from decode for bootstrap_room {state.room} "
                        f"within {self.config.prefill.bootstrap_timeout_s:g} s"), 504
            return None
        if now > state.info_at + self.config.prefill.transfer_timeout_s:
            return (f"the KV of bootstrap_room {state.room} did not reach decode "
                    f"{state.info.peer_name} within {self.config.prefill.transfer_timeout_s:g} s"), 504
        if state.peer is None:
            failure = self.peer_failures.get(state.info.peer_name)
            if failure is not None:
                return f"decode peer {state.info.peer_name} could not be added: {failure}", 500
            return f"decode peer {state.info.peer_name} never registered", 500
        return None

    def _send_ready_blocks(self, state: PrefillRoom, progress) -> None:
        """Write the computed blocks not sent yet, after those the decode holds, into its blocks."""
        skip, dst = state.num_skipped_blocks, state.info.dst_block_ids
        ready = state.blocks_ready(progress.block_ids, progress.num_computed_tokens, progress.finished)
        ready = min(ready, skip + len(dst))
        if ready <= state.num_sent_blocks:
            return
        # With the checksum, in pieces (on tcp): each is digested here just after it is posted (the bytes
        # the send read), and by the decode once its tag says it landed, while the next pieces move.
        piece_bytes = self.config.checksum_piece_bytes if self.config.kv_checksum else 0
        runs = ([(state.num_sent_blocks, ready)] if not piece_bytes
                else pieces(state.num_sent_blocks, ready, self.backend.registered_layout, piece_bytes))
        for first, end in runs:
            handle = self.backend.write(state.peer, progress.block_ids[first:end], list(dst[first - skip:end - skip]),
                                        piece_tag(state.room, first - skip, end - skip))
            if self.config.kv_checksum:
                state.digest = state.digest or KVDigest(self.backend.registered_layout)
                state.digest.update(progress.block_ids[first:end])
            state.handles.append(handle)
            state.num_bytes += handle.num_bytes
            state.num_sent_blocks = end

    def _succeed(self, state: PrefillRoom) -> list[OutputMsg]:
        token_id, top = state.first_token  # top: (id, logprob) pairs, the sampled token first
        self.control.send_status(TransferStatusMsg(
            room=state.room, state=TransferState.SUCCESS, first_token_id=token_id, num_bytes=state.num_bytes,
            first_token_logprob=top[0][1] if top else None, first_token_top_logprobs=top,
            prompt_logprobs=state.prompt_logprobs, prompt_ranks=state.prompt_ranks,
            num_cached_tokens=state.final.num_cached_tokens,
            kv_digest=self._digest(state)))
        stats = state.stats(time.monotonic())
        log.info("kv transferred", bootstrap_room=state.room, request_id=state.request_id, kv_bytes=stats.kv_bytes,
                 bootstrap_wait_s=round(stats.bootstrap_wait_s, 6), prefill_compute_s=round(stats.prefill_compute_s, 6),
                 transfer_s=round(stats.transfer_s, 6), gb_per_s=round(stats.kv_bytes / max(stats.transfer_s, 1e-9) / 1e9, 3))
        self._release(state)
        self.book.settle(state.room, RoomState.SERVED, state.request_id)
        return [msgspec.structs.replace(state.final, kv=stats)]

    def _digest(self, state: PrefillRoom) -> int:
        """With --kv-checksum, the digest of the blocks this room wrote (those after the decode's own
        prefix, in order; kvtransfer/checksum.py), taken as each write was posted; else 0."""
        if not self.config.kv_checksum:
            return 0
        return (state.digest or KVDigest(self.backend.registered_layout)).value()

    def _fail(self, state: PrefillRoom, reason: str, status: int = 500, tell_decode: bool = True,
              code: ErrorCode | None = None) -> list[OutputMsg]:
        """End a room: no write is posted for it any more, the client hears at once. The decode's
        FAILED status waits until every posted write settled (it is the decode's fence)."""
        if status == 499:  # an abort (the router gave up on the pair, its client left) is routine
            log.info("prefill request aborted", bootstrap_room=state.room, request_id=state.request_id, reason=reason)
        else:
            log.warning("prefill request failed", bootstrap_room=state.room, request_id=state.request_id, reason=reason)
        if status != 499 and reason != state.error:  # SGLang's failure counts: aborts and engine errors are neither
            self.num_failed[0 if state.info is None or state.peer is None else 1] += 1
        # A decode that asks about this room later is answered at once, not after its deadline.
        self.book.settle(state.room, RoomState.FAILED, reason)
        # Our source blocks may go back at once: a write still reading them only lands in
        # destination blocks the decode keeps quarantined until our final status.
        self.core.abort(state.request_id, answer=False)  # the answer is ours, with the failure's status
        if tell_decode and state.handles:
            self.settling.append(Settling(state.room, state.info.peer_name, tuple(state.handles), reason,
                                          time.monotonic() + self.config.prefill.transfer_timeout_s))
        else:
            for handle in state.handles:
                self.backend.release(handle)
            if tell_decode:
                self._status(state.room, TransferState.FAILED, reason)
        return [OutputMsg(state.request_id, finish_reason=FinishReason.ABORT, error=reason, error_status=status,
                          error_code=code)]

    def _settle(self, now: float) -> None:
        """Send a failed room's final status once its posted writes all ended; a transport stuck past
        `transfer_timeout_s` gets that decode's stream dropped (it then cuts us off itself)."""
        for entry in list(self.settling):
            if all(self.backend.poll(h).state.is_terminal for h in entry.handles):
                self._status(entry.room, TransferState.FAILED, entry.reason)
            elif now > entry.deadline:
                self.control.drop_peer(entry.peer_name, f"writes of bootstrap_room {entry.room} did not settle "
                                                        f"within {self.config.prefill.transfer_timeout_s:g} s")
            else:
                continue
            for handle in entry.handles:
                self.backend.release(handle)
            self.settling.remove(entry)

    def _release(self, state: PrefillRoom) -> None:
        """A served room's handles and held blocks go back."""
        for handle in state.handles:
            self.backend.release(handle)
        self.core.release(state.request_id)

    def _status(self, room: int, state: TransferState, reason: str) -> None:
        self.control.send_status(TransferStatusMsg(room=room, state=state, reason=reason))

    def _expire(self, now: float) -> None:
        for room, state, _ in self.book.expired(now):
            if state is RoomState.EARLY:
                self._status(room, TransferState.FAILED, f"no prefill request for bootstrap_room {room} arrived here")
