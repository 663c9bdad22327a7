"""Every request a decode worker's role holds, each in one state, moved only along the transitions
written here. Pure Python: the role (decode/role.py) moves them; its queue, its pending fetches, its
verdicts, its local prefills and its fences are all views of this one table.

    QUEUED ──▶ FETCHING ──▶ LANDED ──▶ ADMITTED ──▶ (gone: its first output carried the KV figures)
      │           │  │         │  │
      │           │  └─▶ FENCED ◀──┘──▶ (gone: no write can land in its blocks, they went back)
      └───────────┴─────────────┴──▶ (gone: ended with nothing fenced)
    LOCAL ──▶ (gone: its prompt is computed, or it ended)

A request leaves the table through `drop()`, which only its states allow; an illegal move raises.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from disagg.wire.control_msgs import TransferStatusMsg
from disagg.wire.engine_msgs import KVStatsMsg

from decode.waiting import PendingKV


class DecodeState(enum.Enum):
    QUEUED = "queued"  # admitted, waiting for room in the KV cache: nothing reserved
    FETCHING = "fetching"  # blocks reserved; its flow fetches the prompt's KV
    LANDED = "landed"  # the flow's verdict (SUCCESS, or why not) waits for the next poll
    ADMITTED = "admitted"  # an ordinary running request; its KV figures wait for its first output
    FENCED = "fenced"  # ended; its reserved blocks wait until no write into them can land
    LOCAL = "local"  # sent alone and prefilled here; its prompt is not computed yet


MOVES: dict[DecodeState, frozenset[DecodeState]] = {
    DecodeState.QUEUED: frozenset({DecodeState.FETCHING}),
    DecodeState.FETCHING: frozenset({DecodeState.LANDED, DecodeState.FENCED}),
    DecodeState.LANDED: frozenset({DecodeState.ADMITTED, DecodeState.FENCED}),
    DecodeState.ADMITTED: frozenset(),
    DecodeState.FENCED: frozenset(),
    DecodeState.LOCAL: frozenset(),
}
# Every state may end (drop) but FENCED's only end is its fence's: `drop(..., fenced=True)`.


class IllegalMove(AssertionError):
    """A request moved along a transition MOVES does not have: a bug in the role."""


@dataclass
class DecodeRequest:
    request_id: str
    state: DecodeState
    pending: PendingKV | None = None  # the flow's part (push or pull); None for a local prefill
    prompt_ids: list[int] = field(default_factory=list)  # QUEUED: what to reserve blocks for
    verdict: TransferStatusMsg | Exception | None = None  # LANDED: how the fetch ended
    kv_stats: KVStatsMsg | None = None  # ADMITTED: its KV's bytes and wait, for its first output
    cached_tokens: int = 0  # LOCAL: prompt tokens in the prefix cache when it was admitted


class DecodeRequests:
    """The table, by id and by state (the role polls it every turn: no scan of the whole). Within a
    state, requests keep the order they entered it: QUEUED is arrival order, which the queue serves."""

    def __init__(self) -> None:
        self._by_id: dict[str, DecodeRequest] = {}
        self._by_state: dict[DecodeState, dict[str, DecodeRequest]] = {state: {} for state in DecodeState}

    def add(self, request: DecodeRequest) -> DecodeRequest:
        assert request.request_id not in self._by_id, f"request {request.request_id} held twice"
        assert request.state in (DecodeState.QUEUED, DecodeState.LOCAL), f"a request arrives QUEUED or LOCAL, not {request.state}"
        self._by_id[request.request_id] = request
        self._by_state[request.state][request.request_id] = request
        return request

    def get(self, request_id: str) -> DecodeRequest | None:
        return self._by_id.get(request_id)

    def move(self, request_id: str, state: DecodeState) -> DecodeRequest:
        request = self._by_id[request_id]
        if state not in MOVES[request.state]:
            raise IllegalMove(f"request {request_id}: {request.state.name} -> {state.name}")
        del self._by_state[request.state][request_id]
        request.state = state
        self._by_state[state][request_id] = request
        return request

    def drop(self, request_id: str, *, fenced: bool = False) -> DecodeRequest:
        """The request leaves the role. A FENCED one only when its fence ended (`fenced`), and only it."""
        request = self._by_id[request_id]
        if fenced != (request.state is DecodeState.FENCED):
            raise IllegalMove(f"request {request_id}: {request.state.name} dropped {'by' if fenced else 'without'} its fence")
        del self._by_state[request.state][request_id]
        return self._by_id.pop(request_id)

    def in_state(self, *states: DecodeState) -> list[DecodeRequest]:
        """The requests in any of `states`, each state's in the order they entered it (a copy: the
        caller may move them)."""
        return [r for state in states for r in self._by_state[state].values()]

    def count(self, state: DecodeState) -> int:
        return len(self._by_state[state])

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[DecodeRequest]:
        return iter(list(self._by_id.values()))
