"""Which DP worker serves a request: an external pin, else the load-balance method. Pure Python."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from disagg.config import LoadBalanceMethod
from disagg.dp.rank_rule import implied_rank
from disagg.types import InvalidRequest


class Dispatcher:
    """`round_robin`, `least_load` (fewest outstanding tokens) or `follow_bootstrap_room` (rank_rule.implied_rank)."""

    def __init__(self, method: LoadBalanceMethod, dp_size: int):
        self.method = method
        self.dp_size = dp_size
        self._next = itertools.count()

    def check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.dp_size:
            raise InvalidRequest(f"DP rank {rank} is not active (dp_size={self.dp_size})", "routed_dp_rank")
        return rank

    def pick(self, routed_dp_rank: int | None, bootstrap_room: int | None, loads: Sequence[float], alive: Sequence[bool]) -> int:
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
        return min(candidates, key=lambda r: (loads[r], r))
