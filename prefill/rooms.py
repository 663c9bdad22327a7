"""One prefill request's transfer state: which blocks went out, what is in flight, what to answer.

Plain values only; the prefill role owns the engine, the backend and the control server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from disagg.wire.control_msgs import TransferInfoMsg
from disagg.wire.engine_msgs import KVStatsMsg, OutputMsg
from kvtransfer import TransferHandle


@dataclass
class PrefillRoom:
    room: int
    request_id: str
    deadline: float  # when waiting for the decode's destination blocks gives up
    block_size: int
    created: float = field(default_factory=time.monotonic)
    info: TransferInfoMsg | None = None
    peer: str | None = None  # the decode's name in the transfer backend
    num_sent_blocks: int = 0
    handles: list[TransferHandle] = field(default_factory=list)
    num_bytes: int = 0
    final: OutputMsg | None = None  # the engine's answer, held until the KV landed
    first_token: tuple[int, tuple[tuple[int, float], ...]] | None = None  # token id, its top logprobs
    prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()  # from the second prompt token on, if asked
    info_at: float | None = None
    computed_at: float | None = None
    error: str | None = None  # the engine failed the request: fail the room on the next poll

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
