"""Which prefill DP worker holds a room's KV (DESIGN.md section 3). The decision is pure."""

from __future__ import annotations

from disagg.config import LoadBalanceMethod
from disagg.types import InvalidRequest
from disagg.wire.bootstrap_msgs import TopologyMsg

QUERY = -1  # ask the registry


def decide_prefill_dp_rank(room: int, requested: int | None, topology: TopologyMsg, force_query: bool) -> int:
    """In order: the request's `disagg_prefill_dp_rank`; dp_size 1 → 0; the follow_bootstrap_room
    fast path (room % dp_size) unless forced to query; else QUERY."""
    if requested is not None:
        if isinstance(requested, bool) or not 0 <= requested < topology.dp_size:
            raise InvalidRequest(
                f"disagg_prefill_dp_rank {requested} is not active (prefill dp_size={topology.dp_size})",
                "disagg_prefill_dp_rank",
            )
        return requested
    if topology.dp_size == 1:
        return 0
    if topology.load_balance_method == LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM and not force_query:
        return room % topology.dp_size
    return QUERY
