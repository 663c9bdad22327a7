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
The prompt is then inserted into the chosen tree, which is evicted to `max_tree_size`. The trees and
this decision live in disagg/prefix_tree.py, which a server's DP controller shares (`cache_aware`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from disagg import prefix_tree
from disagg.prefix_tree import CacheOutcome, CacheRule, Prompt, pick_by_cache
from disagg.router.config import CacheAwareConfig
from disagg.router.kv_index import IndexTrees, KVIndex
from disagg.router.errors import NoHealthyServer
from disagg.router.policy import PairPick, ServerLoad

# The router has no tokenizer: a text prompt's characters over this count its tokens (English text
# runs 3.5 to 4.5 characters per token in the Llama-family tokenizers).
CHARS_PER_TOKEN = 4
# With no prefill serving, a request in flight at a decode weighs as this many prompt tokens to
# prefill there: a later turn goes back to the decode holding its history unless that decode has more
# requests in flight than the prefix it holds is worth (a shared system prompt alone is worth ~1).
WHOLE_REQUEST_TOKENS = 256


@dataclass(frozen=True)
class PrefillPick:
    """The chosen prefill (position in the loads given), the rank to pin (None when the server's
    dp_size is unknown or 1), how it was chosen, and the matched share of the prompt."""

    index: int
    dp_rank: int | None
    outcome: CacheOutcome
    match_ratio: float


def cache_rule(config: CacheAwareConfig) -> CacheRule:
    """The shared pick's thresholds from the router's flags (its loads are requests in flight)."""
    return CacheRule(config.cache_threshold, config.balance_abs_threshold, config.balance_rel_threshold,
                     config.max_tree_size)


def is_imbalanced(in_flight: Sequence[int], config: CacheAwareConfig) -> bool:
    """sglang-router's test: both the absolute and the relative gap exceed their thresholds."""
    return prefix_tree.is_imbalanced(in_flight, cache_rule(config))


def pick_power_of_two(loads: Sequence[ServerLoad], rng: random.Random) -> int | None:
    """Two distinct eligible servers drawn at random; the one with fewer requests in flight (ties:
    the first drawn). None when no server is eligible."""
    candidates = [i for i, load in enumerate(loads) if load.eligible]
    if len(candidates) < 2:
        return candidates[0] if candidates else None
    first, second = rng.sample(candidates, 2)
    return second if loads[second].in_flight < loads[first].in_flight else first


class PrefixTrees(prefix_tree.PrefixTrees):
    """The shared trees keyed by (server id, DP rank)."""

    def keep_servers(self, server_ids: set[int]) -> None:
        """Forget the trees of servers the router no longer knows."""
        for tenant in self.tenants():
            if tenant[0] not in server_ids:
                self.forget(tenant)


class CacheAwarePicker:
    """The prefill pick described in the module docstring."""

    def __init__(self, config: CacheAwareConfig, index: KVIndex | None = None):
        self.config = config
        self.rule = cache_rule(config)
        self.trees = PrefixTrees(config.max_tree_size)
        self.index = index  # what the prefills hold, from their KV events (--prefill-kv-events)

    def pick(self, loads: Sequence[ServerLoad], text: Prompt, token_ids: Sequence[int] | None = None) -> PrefillPick | None:
        """The chosen prefill, or None when none is eligible. An empty prompt is a miss that inserts
        nothing. With `token_ids` and an index every eligible (server, rank) has published to, the
        index decides (in tokens), and the text still goes into the chosen tree (the fallback)."""
        self.trees.keep_servers({load.server_id for load in loads})
        candidates = [i for i, load in enumerate(loads) if load.eligible]
        if not candidates:
            return None
        groups = [[(loads[i].server_id, rank) for rank in range(_num_ranks(loads[i]))] for i in candidates]
        loads_in_flight = [loads[i].in_flight for i in candidates]
        if token_ids and self._index_covers(groups):
            p = pick_by_cache(IndexTrees(self.index), groups, loads_in_flight, tuple(token_ids), self.rule)
            if text:
                self.trees.insert(p.tenant, text)
        else:
            p = pick_by_cache(self.trees, groups, loads_in_flight, text, self.rule)
        index, rank = candidates[p.group], p.tenant[1]
        pinned = rank if _num_ranks(loads[index]) > 1 else None
        return PrefillPick(index, pinned, p.outcome, p.match_ratio)

    def _index_covers(self, groups: Sequence[Sequence[tuple[int, int]]]) -> bool:
        """Every (server, rank) of `groups` has published KV events."""
        return self.index is not None and all(self.index.knows(tenant) for tenants in groups for tenant in tenants)

    def events_ready(self, loads: Sequence[ServerLoad]) -> bool:
        """Every eligible prefill (rank) has published: a pick would read the index (worth tokenizing for)."""
        groups = [[(load.server_id, r) for r in range(_num_ranks(load))] for load in loads if load.eligible]
        return bool(groups) and self._index_covers(groups)


def _num_ranks(load: ServerLoad) -> int:
    return load.dp_size if load.dp_size is not None else 1


def estimated_tokens(text: Prompt, num_symbols: int) -> int:
    """`num_symbols` of `text` in tokens: exact for token ids; characters / CHARS_PER_TOKEN (rounded
    up) for text, which the router cannot tokenize."""
    return num_symbols if isinstance(text, tuple) else -(-num_symbols // CHARS_PER_TOKEN)


class DecodePicker:
    """While a decode prefills short rests itself (its `--max-local-prefill-tokens`, read from its
    /server_info into `ServerLoad.max_local_prefill_tokens`): the decode by the same cache-aware pick
    over a tree per decode server (a conversation goes back to the decode that holds it), and whether
    its prefix leaves at most its limit of tokens for it to prefill itself."""

    def __init__(self, config: CacheAwareConfig):
        self.rule = cache_rule(config)
        self.trees = PrefixTrees(config.max_tree_size)
        self.local_servers: frozenset[int] = frozenset()  # server ids that prefilled locally at the last pick

    def wanted(self, loads: Sequence[ServerLoad]) -> bool:
        """Some eligible decode prefills short rests itself (else the decode goes by power of two)."""
        self.local_servers = frozenset(load.server_id for load in loads if load.max_local_prefill_tokens > 0)
        return any(load.eligible and load.max_local_prefill_tokens > 0 for load in loads)

    def pick(self, loads: Sequence[ServerLoad], text: Prompt) -> tuple[int, bool] | None:
        """(the decode's position, whether it prefills the request itself); None when none is eligible."""
        self.trees.keep_servers({load.server_id for load in loads})
        candidates = [i for i, load in enumerate(loads) if load.eligible]
        if not candidates:
            return None
        groups = [[(loads[i].server_id, 0)] for i in candidates]
        p = pick_by_cache(self.trees, groups, [loads[i].in_flight for i in candidates], text, self.rule)
        # A hit's ratio is the chosen tree's match over the prompt (measured before the prompt went in).
        uncached = estimated_tokens(text, len(text) - round(p.match_ratio * len(text)))
        chosen = candidates[p.group]
        local = p.outcome is CacheOutcome.HIT and uncached <= loads[chosen].max_local_prefill_tokens
        return chosen, local

    def pick_whole(self, loads: Sequence[ServerLoad], text: Prompt) -> int | None:
        """No prefill serves: the decode (of those that prefill locally) with the least to do for this
        request, its uncached tokens plus WHOLE_REQUEST_TOKENS a request in flight (ties: the smaller
        tree, then the first); None when none is eligible. The prompt goes into its tree."""
        self.trees.keep_servers({load.server_id for load in loads})
        candidates = [i for i, load in enumerate(loads) if load.eligible and load.max_local_prefill_tokens > 0]
        if not candidates:
            return None

        def cost(i: int) -> tuple[int, int]:
            tenant = (loads[i].server_id, 0)
            uncached = estimated_tokens(text, len(text) - self.trees.match_length(tenant, text))
            return uncached + WHOLE_REQUEST_TOKENS * loads[i].in_flight, self.trees.size(tenant)

        chosen = min(candidates, key=cost)
        if text:
            self.trees.insert((loads[chosen].server_id, 0), text)
        return chosen


class CacheAwarePairPicker:
    """`--policy cache_aware`: the prefill (and rank) by CacheAwarePicker; the decode by power of
    two, or while a decode prefills short rests itself by DecodePicker, which may send a request to the
    decode alone (`PairPick.local`: no prefill is picked, its trees are left as they were)."""

    uses_text = True  # the proxy passes each request's prompt (bodies.routing_text)
    learns_answers = True  # a decode's answers go into its tree (one that prefills short rests itself)

    def __init__(self, config: CacheAwareConfig, rng: random.Random | None = None, index: KVIndex | None = None):
        self.prefill = CacheAwarePicker(config, index)
        self.decode = DecodePicker(config)
        self._rng = rng if rng is not None else random.Random()

    def pick(self, prefill: Sequence[ServerLoad], decode: Sequence[ServerLoad], text: Prompt,
             local_ok: bool = True, token_ids: Sequence[int] | None = None) -> PairPick:
        """The pair; NoHealthyServer names the role that has none (the trees are then left as they were).
        `local_ok` False: a prefill whatever the decode holds (its local prefill was refused).
        `token_ids`: the prompt as the prefill tokenizes it, for the KV-event index. With no eligible
        prefill, a decode that prefills locally takes the whole request (`PairPick.whole`): a planner
        that moved the last prefill to decode, or a prefill down, leaves every decode prefilling its own."""
        if not any(load.eligible for load in prefill):
            if self.decode.wanted(decode):
                d = self.decode.pick_whole(decode, text)
                if d is not None:
                    return PairPick(None, d, whole=True)
            raise NoHealthyServer("prefill")
        d, local = self._pick_decode(decode, text)
        if local and local_ok and self._prefills_busy(prefill):
            return PairPick(None, d)
        p = self.prefill.pick(prefill, text, token_ids)
        assert p is not None, "an eligible prefill was checked above"
        return PairPick(p.index, d, p.dp_rank, p.outcome, p.match_ratio)

    def _prefills_busy(self, prefill: Sequence[ServerLoad]) -> bool:
        """Every eligible prefill has at least --local-prefill-min-prefill-load prefill legs unanswered."""
        floor = self.prefill.config.local_prefill_min_prefill_load
        return min(load.prefilling for load in prefill if load.eligible) >= floor

    def wants_token_ids(self, prefill: Sequence[ServerLoad]) -> bool:
        """The KV-event index steers the prefill pick once every eligible prefill publishes."""
        return self.prefill.index is not None and self.prefill.events_ready(prefill)

    def learn_answer(self, decode_server_id: int, text: Prompt) -> None:
        """Record a prompt and the answer its decode gave in that decode's tree (it holds both now)."""
        if decode_server_id in self.decode.local_servers:
            self.decode.trees.insert((decode_server_id, 0), text)

    def _pick_decode(self, decode: Sequence[ServerLoad], text: Prompt) -> tuple[int, bool]:
        """(the decode's position, whether it prefills the request itself)."""
        if self.decode.wanted(decode):
            picked = self.decode.pick(decode, text)
        else:
            d = pick_power_of_two(decode, self._rng)
            picked = None if d is None else (d, False)
        if picked is None:
            raise NoHealthyServer("decode")
        return picked
