"""Which prefill DP rank holds a room's KV (docs/api.md, "Which prefill DP rank holds a room's KV"), in one place. Pure.

The prefill front dispatches, plans and refuses rooms by it; the decode resolves the rank by it; the
DP dispatcher's `follow_bootstrap_room` method is it. `implied_rank` is the rule's only modulo.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config import LoadBalanceMethod
from disagg.types import InvalidRequest

FORCE_QUERY_FLAG = "DISAGG_FORCE_QUERY_PREFILL_DP_RANK"


def implied_rank(room: int, dp_size: int) -> int:
    """The rank `follow_bootstrap_room` puts a room on, and where a decode looks for it unasked."""
    return room % dp_size


@dataclass(frozen=True)
class RoomPlan:
    register: bool  # tell the bootstrap registry (room -> this rank); the decode will query it
    conflict: str | None = None  # the request must fail at once, with this message


def plan_room(*, dp_size: int, method: LoadBalanceMethod, dp_rank: int, room: int | None, decode_told: bool,
              force_query: bool, implied_alive: bool = True) -> RoomPlan:
    """Prefill side: what the front does with a room dispatched to `dp_rank`.

    `decode_told`: the request carries disagg_prefill_dp_rank, so the decode skips the registry.
    `implied_alive`: the rank follow_bootstrap_room implies is up; when it is down the room lives on
    another rank, registered, and a decode that cannot reach the implied rank asks the registry."""
    if room is None or dp_size == 1 or decode_told:
        return RoomPlan(register=False)
    if method != LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM or force_query:
        return RoomPlan(register=True)  # the decode asks the registry (with the flag it always does)
    implied = implied_rank(room, dp_size)
    if dp_rank == implied:
        return RoomPlan(register=False)
    if not implied_alive:
        return RoomPlan(register=True)
    return RoomPlan(register=False, conflict=(
        f"bootstrap_room {room} was dispatched to prefill DP rank {dp_rank}, but load_balance_method "
        f"follow_bootstrap_room implies rank {implied} (room % dp_size={dp_size}), where the decode looks for its KV; "
        f"set {FORCE_QUERY_FLAG}=1 on the prefill and decode servers to resolve the rank through the bootstrap registry, "
        f"or send disagg_prefill_dp_rank={dp_rank}"
    ))


def resolve_prefill_rank(room: int, requested: int | None, *, dp_size: int, method: LoadBalanceMethod,
                         force_query: bool) -> int | None:
    """Decode side, in order: the request's `disagg_prefill_dp_rank`; dp_size 1 → 0; the
    follow_bootstrap_room fast path (no round trip) unless forced to query; else None: only the
    bootstrap registry knows the rank (the decode asks it)."""
    if requested is not None:
        if isinstance(requested, bool) or not 0 <= requested < dp_size:
            raise InvalidRequest(f"disagg_prefill_dp_rank {requested} is not active (prefill dp_size={dp_size})",
                                 "disagg_prefill_dp_rank")
        return requested
    if dp_size == 1:
        return 0
    if method == LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM and not force_query:
        return implied_rank(room, dp_size)
    return None
