"""Every room a prefill worker knows, each in one state, and one request's transfer state.

`RoomBook` holds every bootstrap room of one worker in one `RoomState`, moved only along `MOVES`: the
running rooms (a `PrefillRoom` each: which blocks went out, what is in flight, what to answer) and
the verdicts kept for a while after (a decode that asks later is answered at once). Plain values
only; the push flow (prefill/push.py) owns the engine, the backend and the control server.

    (new) ──▶ EARLY ──▶ WAITING ──▶ SENDING ──▶ SERVED
      │         │          │           │
      ├─────────┴──────────┴───────────┴──▶ FAILED        ELSEWHERE: placed on another rank
      └──▶ ELSEWHERE / FAILED / WAITING       (the verdicts EARLY, FAILED, SERVED, ELSEWHERE expire)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from disagg.wire.control_msgs import TransferInfoMsg
from disagg.wire.engine_msgs import KVStatsMsg, OutputMsg
from kvtransfer import TransferHandle
from kvtransfer.checksum import KVDigest


class RoomState(enum.Enum):
    EARLY = "early"  # a decode's TransferInfo came before the request: kept until it arrives, or expires
    WAITING = "waiting"  # the request runs here; no destination yet
    SENDING = "sending"  # the destination is known: blocks go out as they are computed
    SERVED = "served"  # its KV went out: a second decode for it is refused at once
    FAILED = "failed"  # it failed here: a decode that asks later hears FAILED at once
    ELSEWHERE = "elsewhere"  # the front placed it on another rank: a decode that asks here was misrouted


RUNNING = frozenset({RoomState.WAITING, RoomState.SENDING})  # a PrefillRoom; the others are verdicts with a TTL
NEW = None  # not in the book
MOVES: dict[RoomState | None, frozenset[RoomState | None]] = {
    NEW: frozenset({RoomState.EARLY, RoomState.WAITING, RoomState.FAILED, RoomState.ELSEWHERE}),
    RoomState.EARLY: frozenset({RoomState.EARLY, RoomState.WAITING, RoomState.FAILED, RoomState.ELSEWHERE, NEW}),
    RoomState.WAITING: frozenset({RoomState.SENDING, RoomState.FAILED}),
    RoomState.SENDING: frozenset({RoomState.SENDING, RoomState.SERVED, RoomState.FAILED}),  # a second TransferInfo re-attaches
    RoomState.SERVED: frozenset({RoomState.WAITING, RoomState.FAILED, RoomState.ELSEWHERE, NEW}),
    RoomState.FAILED: frozenset({RoomState.WAITING, RoomState.FAILED, RoomState.ELSEWHERE, NEW}),
    RoomState.ELSEWHERE: frozenset({RoomState.WAITING, RoomState.FAILED, RoomState.ELSEWHERE, NEW}),
}


class IllegalMove(AssertionError):
    """A room moved along a transition MOVES does not have: a bug in the push flow."""


@dataclass
class PrefillRoom:
    room: int
    request_id: str
    deadline: float  # when waiting for the decode's destination blocks gives up
    block_size: int
    state: RoomState = RoomState.WAITING
    created: float = field(default_factory=time.monotonic)
    info: TransferInfoMsg | None = None
    peer: str | None = None  # the decode's name in the transfer backend
    num_sent_blocks: int = 0
    handles: list[TransferHandle] = field(default_factory=list)
    num_bytes: int = 0
    final: OutputMsg | None = None  # the engine's answer, held until the KV landed
    first_token: tuple[int, tuple[tuple[int, float], ...]] | None = None  # token id, its top logprobs
    prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # from the second prompt token on, if asked
    prompt_ranks: tuple[int, ...] = ()  # with them: each actual prompt token's rank
    info_at: float | None = None
    computed_at: float | None = None
    error: str | None = None  # the engine failed the request: fail the room on the next poll
    digest: KVDigest | None = None  # --kv-checksum: the blocks written so far, digested as each write is posted

    def stats(self, now: float) -> KVStatsMsg:
        """Time split of a delivered room. `transfer_s` is what the transfer adds after both the
        prompt is computed and the destination is known (blocks sent earlier overlap compute)."""
        info_at = self.info_at or now
        computed_at = self.computed_at or now
        return KVStatsMsg(
            bootstrap_wait_s=info_at - self.created,
            prefill_compute_s=computed_at - self.created,
            transfer_s=now - max(computed_at, info_at),
            kv_bytes=self.num_bytes,
            decode_traceparent=self.info.traceparent if self.info is not None else "",
        )

    def blocks_ready(self, block_ids: list[int], num_computed_tokens: int, finished: bool) -> int:
        """How many leading blocks may be sent: full computed ones, or all once the prompt is done."""
        return len(block_ids) if finished else min(num_computed_tokens // self.block_size, len(block_ids))

    @property
    def num_skipped_blocks(self) -> int:
        """Leading blocks the decode holds already (its own prefix cache): never sent."""
        return 0 if self.info is None else self.info.num_cached_tokens // self.block_size

    @property
    def all_sent(self) -> bool:
        return self.info is not None and self.num_sent_blocks == self.num_skipped_blocks + len(self.info.dst_block_ids)


@dataclass(frozen=True)
class Settling:
    """A failed room whose posted writes may still be landing: its decode hears FAILED (and reuses
    the destination blocks) only once every handle ended."""

    room: int
    peer_name: str  # the decode's name on the control plane
    handles: tuple[TransferHandle, ...]
    reason: str
    deadline: float


class RoomTable(dict):
    """room -> (value, deadline), every entry living `ttl_s`: `put` moves a room to the end, so the
    table stays in deadline order and `pop_expired` stops at the first live entry instead of
    scanning (the front tells every rank about every room dispatched elsewhere: at a few hundred
    rooms a second a table holds thousands, and the role expires them on every poll)."""

    def __init__(self, ttl_s: float):
        super().__init__()
        self.ttl_s = ttl_s

    def put(self, room: int, value, now: float | None = None) -> None:
        self.pop(room, None)
        self[room] = (value, (time.monotonic() if now is None else now) + self.ttl_s)

    def pop_expired(self, now: float) -> list[tuple[int, object]]:
        """Remove and return (room, value) of every entry whose deadline passed, oldest first."""
        expired = []
        for room, (value, deadline) in self.items():
            if deadline >= now:
                break
            expired.append((room, value))
        for room, _ in expired:
            del self[room]
        return expired


class RoomBook:
    """Every room of one worker in one state: the running ones by room and by request id, the
    verdicts (EARLY with its TransferInfo, FAILED with its reason, SERVED with its request id,
    ELSEWHERE with its rank) in deadline order, each kept `ttl_s`."""

    def __init__(self, ttl_s: float):
        self.running: dict[int, PrefillRoom] = {}
        self.by_request: dict[str, int] = {}
        self._verdicts = RoomTable(ttl_s)  # room -> ((state, value), expiry)
        self._early: set[int] = set()  # the EARLY rooms (a worker with one polls at once)

    @property
    def num_early(self) -> int:
        return len(self._early)

    def state_of(self, room: int) -> RoomState | None:
        if room in self.running:
            return self.running[room].state
        entry = self._verdicts.get(room)
        return None if entry is None else entry[0][0]

    def verdict(self, room: int):
        """The value a verdict state keeps (a TransferInfo, a reason, a request id, a rank)."""
        return self._verdicts[room][0][1]

    def _check(self, room: int, state: RoomState | None) -> None:
        now = self.state_of(room)
        if state not in MOVES[now]:
            raise IllegalMove(f"bootstrap_room {room}: {getattr(now, 'name', 'NEW')} -> {getattr(state, 'name', 'NEW')}")

    def start(self, state: PrefillRoom) -> None:
        """A request for the room arrived: it runs here (WAITING)."""
        self._check(state.room, RoomState.WAITING)
        self._verdicts.pop(state.room, None)
        self._early.discard(state.room)
        self.running[state.room] = state
        self.by_request[state.request_id] = state.room

    def attach(self, room: int) -> PrefillRoom:
        """Its destination is known: SENDING."""
        self._check(room, RoomState.SENDING)
        self.running[room].state = RoomState.SENDING
        return self.running[room]

    def settle(self, room: int, state: RoomState, value, now: float | None = None) -> None:
        """The room ends here, or is heard of: a verdict state (EARLY, FAILED, SERVED, ELSEWHERE) kept `ttl_s`."""
        assert state not in RUNNING, f"{state} is not a verdict"
        self._check(room, state)
        running = self.running.pop(room, None)
        if running is not None:
            self.by_request.pop(running.request_id, None)
        self._verdicts.put(room, (state, value), now)
        if state is RoomState.EARLY:
            self._early.add(room)
        else:
            self._early.discard(room)

    def forget(self, room: int) -> None:
        """A verdict no longer kept (taken, answered, or expired)."""
        self._check(room, NEW)
        self._verdicts.pop(room, None)
        self._early.discard(room)

    def expired(self, now: float) -> list[tuple[int, RoomState, object]]:
        """(room, state, value) of every verdict whose time passed, taken out of the book."""
        expired = [(room, state, value) for room, (state, value) in self._verdicts.pop_expired(now)]
        self._early.difference_update(room for room, _, _ in expired)
        return expired

    def __len__(self) -> int:
        return len(self.running) + len(self._verdicts)
