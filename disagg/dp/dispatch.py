"""Which DP worker serves a request: an external pin, else the load-balance method. Pure Python."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from disagg.config import LoadBalanceMethod
from disagg.rank_rule import implied_rank
from disagg.prefix_tree import CacheOutcome, CacheRule, PrefixTrees, Prompt, pick_by_cache
from disagg.types import InvalidRequest
from disagg.wire.engine_msgs import GenerateMsg

# sgl-model-gateway's thresholds, but a DP worker's load is outstanding estimated tokens, not
# requests: 64 requests' gap there is taken as 64 requests of 32 tokens here.
DP_CACHE_RULE = CacheRule(balance_abs_threshold=64 * 32)


def routing_prompt(msg: GenerateMsg) -> Prompt:
    """What cache_aware matches: the prompt text, else its token ids, else the chat messages' contents joined."""
    if msg.prompt is not None:
        return msg.prompt
    if msg.prompt_token_ids is not None:
        return tuple(msg.prompt_token_ids)
    return "\n".join(str(m.get("content", "")) for m in msg.messages or [])


def estimate_tokens(msg: GenerateMsg, max_model_len: int) -> int:
    """Outstanding-token estimate for least_load, before the worker has tokenized anything."""
    if msg.prompt_token_ids is not None:
        prompt = len(msg.prompt_token_ids)
    else:
        prompt = len(msg.prompt or "") // 4 + sum(len(str(m.get("content", ""))) for m in msg.messages or []) // 4
    sampling = msg.sampling
    # 0 is a prompt-only request; unset is the endpoint's default, else up to the context.
    limit = sampling.max_tokens if sampling.max_tokens is not None else sampling.default_max_tokens or max_model_len
    return prompt + limit


class Dispatcher:
    """`round_robin`, `least_load` (fewest outstanding tokens), `follow_bootstrap_room`
    (rank_rule.implied_rank) or `cache_aware` (one prefix tree per worker; prefix_tree.pick_by_cache
    over the outstanding tokens)."""

    def __init__(self, method: LoadBalanceMethod, dp_size: int, cache_rule: CacheRule = DP_CACHE_RULE):
        self.method = method
        self.dp_size = dp_size
        self._next = itertools.count()
        self.cache_rule = cache_rule
        self.trees = PrefixTrees(cache_rule.max_tree_size)  # tenant: the DP rank
        self.num_cache_hits = 0
        self.num_cache_misses = 0  # misses and imbalanced picks: the trees did not decide

    def check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.dp_size:
            raise InvalidRequest(f"DP rank {rank} is not active (dp_size={self.dp_size})", "routed_dp_rank")
        return rank

    def pick(self, routed_dp_rank: int | None, bootstrap_room: int | None, loads: Sequence[float], alive: Sequence[bool],
             prompt: Prompt = "") -> int:
        """An external `routed_dp_rank` wins; otherwise the method decides among live workers."""
        if routed_dp_rank is not None:
            return self.check_rank(routed_dp_rank)
        if self.method == LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM and bootstrap_room is not None:
            rank = implied_rank(bootstrap_room, self.dp_size)
            if alive[rank] or not any(alive):
                return rank
            # Its rank is down: the least loaded live one takes the room (and registers it).
        # follow_bootstrap_room without a room (a pull-flow or health request): the least loaded.
        candidates = [r for r in range(self.dp_size) if alive[r]] or list(range(self.dp_size))
        if self.method == LoadBalanceMethod.ROUND_ROBIN:
            return candidates[next(self._next) % len(candidates)]
        if self.method == LoadBalanceMethod.CACHE_AWARE:
            return self._pick_by_cache(candidates, loads, alive, prompt)
        return min(candidates, key=lambda r: (loads[r], r))

    def _pick_by_cache(self, candidates: list[int], loads: Sequence[float], alive: Sequence[bool], prompt: Prompt) -> int:
        for rank in range(self.dp_size):
            if not alive[rank]:
                self.trees.forget(rank)  # a restarted worker starts with an empty cache
        pick = pick_by_cache(self.trees, [[r] for r in candidates], [loads[r] for r in candidates], prompt, self.cache_rule)
        if pick.outcome is CacheOutcome.HIT:
            self.num_cache_hits += 1
        else:
            self.num_cache_misses += 1
        return pick.tenant
