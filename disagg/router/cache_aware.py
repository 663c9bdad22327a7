"""`--policy cache_aware`: sglang-router's (sgl-model-gateway's) cache-aware pick of a prefill server,
and of its DP rank, from an approximate radix tree per (server, rank) of the prompts routed there;
the decode by power of two choices. Pure: no I/O, no clock; randomness is injected.

The prefill pick, in order:
1. Imbalanced (`max - min > balance_abs_threshold` and `max > min * balance_rel_threshold`, over the
   requests in flight of the eligible prefill servers): the least loaded server (ties: the first),
   and of its ranks the one with the smallest tree.
2. Else the (server, rank) whose tree holds the longest prefix of the prompt (ties: the first); if
   `matched / len(prompt) > cache_threshold` it is a hit and gets the request.
3. Else a miss: the (server, rank) with the smallest tree (the most free cache; ties: the first).
The prompt is then inserted into the chosen tree, which is evicted to `max_tree_size`.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass

from disagg.router.config import CacheAwareConfig
from disagg.router.errors import NoHealthyServer
from disagg.router.policy import PairPick, ServerLoad
from disagg.router.radix_tree import Prompt, RadixTree

Tenant = tuple[int, int]  # (server id, DP rank): one tree each


class CacheOutcome(str, enum.Enum):
    HIT = "hit"  # the longest match is above the threshold
    MISS = "miss"  # the smallest tree got it
    IMBALANCED = "imbalanced"  # the shortest queue got it; the trees were not asked

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PrefillPick:
    """The chosen prefill (position in the loads given), the rank to pin (None when the server's
    dp_size is unknown or 1), how it was chosen, and the matched share of the prompt."""

    index: int
    dp_rank: int | None
    outcome: CacheOutcome
    match_ratio: float


def is_imbalanced(in_flight: Sequence[int], config: CacheAwareConfig) -> bool:
    """sglang-router's test: both the absolute and the relative gap exceed their thresholds."""
    most, fewest = max(in_flight), min(in_flight)
    return most - fewest > config.balance_abs_threshold and most > fewest * config.balance_rel_threshold


def pick_power_of_two(loads: Sequence[ServerLoad], rng: random.Random) -> int | None:
    """Two distinct eligible servers drawn at random; the one with fewer requests in flight (ties:
    the first drawn). None when no server is eligible."""
    candidates = [i for i, load in enumerate(loads) if load.eligible]
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    first, second = rng.sample(candidates, 2)
    return second if loads[second].in_flight < loads[first].in_flight else first


class PrefixTrees:
    """One RadixTree per tenant, and the clock of their recency."""

    def __init__(self, max_tree_size: int):
        self.max_tree_size = max_tree_size
        self._trees: dict[Tenant, RadixTree] = {}
        self._tick = 0

    def size(self, tenant: Tenant) -> int:
        """Symbols held for `tenant` (0 when it has no tree yet)."""
        tree = self._trees.get(tenant)
        return tree.size if tree is not None else 0

    def match_length(self, tenant: Tenant, text: Prompt) -> int:
        """The longest prefix of `text` held for `tenant`."""
        tree = self._trees.get(tenant)
        return tree.match_length(text) if tree is not None else 0

    def insert(self, tenant: Tenant, text: Prompt) -> None:
        """Record `text` as the newest prompt of `tenant`, then evict its tree to the bound."""
        self._tick += 1
        tree = self._trees.setdefault(tenant, RadixTree())
        tree.insert(text, self._tick)
        tree.evict_to(self.max_tree_size)

    def keep_servers(self, server_ids: set[int]) -> None:
        """Forget the trees of servers the router no longer knows."""
        for tenant in [t for t in self._trees if t[0] not in server_ids]:
            del self._trees[tenant]


class CacheAwarePicker:
    """The prefill pick described in the module docstring."""

    def __init__(self, config: CacheAwareConfig):
        self.config = config
        self.trees = PrefixTrees(config.max_tree_size)

    def pick(self, loads: Sequence[ServerLoad], text: Prompt) -> PrefillPick | None:
        """The chosen prefill, or None when none is eligible. An empty prompt is a miss that inserts nothing."""
        self.trees.keep_servers({load.server_id for load in loads})
        candidates = [i for i, load in enumerate(loads) if load.eligible]
        if not candidates:
            return None
        tenants = [(i, rank) for i in candidates for rank in range(_num_ranks(loads[i]))]
        ratio = 0.0
        if is_imbalanced([loads[i].in_flight for i in candidates], self.config):
            fewest = min(candidates, key=lambda i: loads[i].in_flight)
            index, rank = self._smallest(loads, [t for t in tenants if t[0] == fewest])
            outcome = CacheOutcome.IMBALANCED
        else:
            (index, rank), matched = self._longest_match(loads, tenants, text)
            ratio = matched / len(text) if text else 0.0
            outcome = CacheOutcome.HIT if ratio > self.config.cache_threshold else CacheOutcome.MISS
            if outcome is CacheOutcome.MISS:
                index, rank = self._smallest(loads, tenants)
        if text:
            self.trees.insert((loads[index].server_id, rank), text)
        pinned = rank if _num_ranks(loads[index]) > 1 else None
        return PrefillPick(index, pinned, outcome, ratio)

    def _longest_match(self, loads: Sequence[ServerLoad], tenants: list[Tenant], text: Prompt) -> tuple[Tenant, int]:
        lengths = [self.trees.match_length((loads[i].server_id, rank), text) for i, rank in tenants]
        best = max(range(len(tenants)), key=lambda k: (lengths[k], -k))
        return tenants[best], lengths[best]

    def _smallest(self, loads: Sequence[ServerLoad], tenants: list[Tenant]) -> Tenant:
        return min(tenants, key=lambda t: self.trees.size((loads[t[0]].server_id, t[1])))


def _num_ranks(load: ServerLoad) -> int:
    return load.dp_size if load.dp_size is not None else 1


class CacheAwarePairPicker:
    """`--policy cache_aware`: the prefill (and rank) by CacheAwarePicker, the decode by power of two."""

    uses_text = True  # the proxy passes each request's prompt (bodies.routing_text)

    def __init__(self, config: CacheAwareConfig, rng: random.Random | None = None):
        self.prefill = CacheAwarePicker(config)
        self._rng = rng if rng is not None else random.Random()

    def pick(self, prefill: Sequence[ServerLoad], decode: Sequence[ServerLoad], text: Prompt) -> PairPick:
        """The pair; NoHealthyServer names the role that has none (the trees are then left as they were)."""
        if not any(load.eligible for load in prefill):
            raise NoHealthyServer("prefill")
        d = pick_power_of_two(decode, self._rng)
        if d is None:
            raise NoHealthyServer("decode")
        p = self.prefill.pick(prefill, text)
        assert p is not None, "an eligible prefill was checked above"
        return PairPick(p.index, d, p.dp_rank, p.outcome, p.match_ratio)
