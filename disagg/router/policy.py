"""Pure routing policy: which prefill and decode server serve a request, its bootstrap room, and
(in the external-DP-routing test mode) the DP rank pinned on each leg.

No I/O and no clock; randomness is injected, so tests assert exact picks.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from disagg.config import Choice
from disagg.prefix_tree import CacheOutcome
from disagg.router.errors import NoHealthyServer

ROOM_BITS = 63  # SGLang draws rooms in [0, 2**63): they fit a signed 64-bit integer everywhere


class Policy(Choice):
    """How one server is picked among the healthy servers of a role."""

    ROUND_ROBIN = "round_robin"  # next healthy server after the previous pick
    RANDOM = "random"  # uniform among healthy servers
    LEAST_LOAD = "least_load"  # fewest requests in flight; ties go round-robin
    CACHE_AWARE = "cache_aware"  # prefill by prompt prefix (cache_aware.py); decode by power of two, or by prefix with local prefill


@dataclass(frozen=True)
class ServerLoad:
    """What the policy knows about one server: whether it may be picked, and its requests in flight."""

    eligible: bool
    in_flight: int = 0
    server_id: int = 0  # the pool's id: stable while positions shift as servers come and go
    dp_size: int | None = None  # from /server_info; None until read
    prefilling: int = 0  # prefill servers: legs sent that have not answered (its queue, as the router sees it)
    max_local_prefill_tokens: int = 0  # decode servers: the rest it prefills itself, from /server_info (0: none)


@dataclass(frozen=True)
class PairPick:
    """The chosen pair (positions in the loads given), and the prefill DP rank to pin, if any."""

    prefill: int | None  # None: the decode prefills the request itself (--max-local-prefill-tokens)
    decode: int
    prefill_dp_rank: int | None = None
    cache_outcome: CacheOutcome | None = None  # cache_aware only
    match_ratio: float = 0.0  # cache_aware only: the matched share of the prompt (0 when imbalanced)
    whole: bool = False  # no prefill serves: the decode prefills the whole prompt (cache_aware only)

    @property
    def local(self) -> bool:
        """No prefill leg: the decode prefills the request itself."""
        return self.prefill is None


class ServerPicker:
    """Picks one server of one role. Keeps only a round-robin cursor (an index, not a server)."""

    def __init__(self, policy: Policy, rng: random.Random):
        self.policy = policy
        self._rng = rng
        self._cursor = 0

    def pick(self, loads: Sequence[ServerLoad]) -> int | None:
        """The index of the chosen server, or None when no server is eligible."""
        candidates = [i for i, load in enumerate(loads) if load.eligible]
        if not candidates:
            return None
        if self.policy is Policy.RANDOM:
            return self._rng.choice(candidates)
        if self.policy is Policy.LEAST_LOAD:
            fewest = min(loads[i].in_flight for i in candidates)
            candidates = [i for i in candidates if loads[i].in_flight == fewest]
        return self._next_from_cursor(candidates, len(loads))

    def _next_from_cursor(self, candidates: list[int], num_servers: int) -> int:
        """The first candidate at or after the cursor (wrapping), and the cursor moves past it."""
        after = [i for i in candidates if i >= self._cursor]
        chosen = after[0] if after else candidates[0]
        self._cursor = (chosen + 1) % num_servers
        return chosen


class PairPolicy(Protocol):
    """What the proxy asks of a pair policy: PairPicker, or cache_aware.CacheAwarePairPicker."""

    uses_text: bool  # the proxy passes each request's prompt to pick()
    learns_answers: bool  # the proxy hands each answer to learn_answer()

    def pick(self, prefill: Sequence[ServerLoad], decode: Sequence[ServerLoad], text: object = None,
             local_ok: bool = True, token_ids: Sequence[int] | None = None) -> PairPick:
        """The pair for one request; NoHealthyServer names the role that has none."""

    def wants_token_ids(self, prefill: Sequence[ServerLoad]) -> bool:
        """Whether the prompt's token ids (a prefill's /tokenize) would steer the pick now."""

    def learn_answer(self, decode_server_id: int, text: object) -> None:
        """Record a prompt and the answer its decode gave."""


class PairPicker:
    """Picks a (prefill, decode) pair; each role has its own cursor. A PairPolicy that reads no
    prompt, no token ids and no answers."""

    uses_text = False  # the prompt does not matter to these policies
    learns_answers = False

    def __init__(self, policy: Policy | str, rng: random.Random | None = None):
        policy = Policy(policy)
        if policy is Policy.CACHE_AWARE:
            raise ValueError("cache_aware pairs are picked by cache_aware.CacheAwarePairPicker")
        rng = rng if rng is not None else random.Random()
        self.policy = policy
        self._prefill = ServerPicker(policy, rng)
        self._decode = ServerPicker(policy, rng)

    def pick_pair(self, prefill: Sequence[ServerLoad], decode: Sequence[ServerLoad]) -> tuple[int, int]:
        """(prefill index, decode index); NoHealthyServer names the role that has none."""
        p = self._prefill.pick(prefill)
        if p is None:
            raise NoHealthyServer("prefill")
        d = self._decode.pick(decode)
        if d is None:
            raise NoHealthyServer("decode")
        return p, d

    def pick(self, prefill: Sequence[ServerLoad], decode: Sequence[ServerLoad], text: object = None,
             local_ok: bool = True, token_ids: object = None) -> PairPick:
        """`pick_pair` as a PairPick; `text`, `local_ok` and `token_ids` are not used (these policies
        always prefill remotely and read no cache)."""
        return PairPick(*self.pick_pair(prefill, decode))

    def wants_token_ids(self, prefill: Sequence[ServerLoad]) -> bool:
        return False

    def learn_answer(self, decode_server_id: int, text: object) -> None:
        """Never called (learns_answers is False): these policies keep no trees."""


def draw_bootstrap_room(randbits: Callable[[int], int] = secrets.randbits) -> int:
    """A fresh room id in [0, 2**63); `randbits` is `secrets.randbits` unless a test injects one."""
    room = randbits(ROOM_BITS)
    assert 0 <= room < 1 << ROOM_BITS, f"room {room} outside 63 bits"
    return room


def draw_rooms(count: int | None, randbits: Callable[[int], int] = secrets.randbits) -> int | list[int]:
    """One room, or `count` distinct rooms for a batched /generate request (one per prompt)."""
    if count is None:
        return draw_bootstrap_room(randbits)
    rooms: list[int] = []
    while len(rooms) < count:
        room = draw_bootstrap_room(randbits)
        if room not in rooms:
            rooms.append(room)
    return rooms


def pick_dp_rank(dp_size: int, rng: random.Random) -> int:
    """A uniformly random DP rank in [0, dp_size) (external-DP-routing test mode)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be at least 1, got {dp_size}")
    return rng.randrange(dp_size)
