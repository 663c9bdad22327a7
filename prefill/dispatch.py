"""Prefill side of DP-rank resolution (DESIGN.md section 3): register the room, or refuse it. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.config import LoadBalanceMethod

FLAG = "DISAGG_FORCE_QUERY_PREFILL_DP_RANK"


@dataclass(frozen=True)
class RoomPlan:
    register: bool  # tell the bootstrap registry (room -> this rank); the decode will query it
    conflict: str | None = None  # the request must fail at once, with this message


def plan_room(*, dp_size: int, method: LoadBalanceMethod, dp_rank: int, room: int | None, decode_told: bool, force_query: bool) -> RoomPlan:
    """What a prefill server does with a room dispatched to `dp_rank`.

    `decode_told`: the request carries disagg_prefill_dp_rank, so the decode skips the registry."""
    if room is None or dp_size == 1 or decode_told:
        return RoomPlan(register=False)
    if method != LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM or force_query:
        return RoomPlan(register=True)  # the decode asks the registry (with the flag it always does)
    implied = room % dp_size
    if dp_rank == implied:
        return RoomPlan(register=False)
    return RoomPlan(register=False, conflict=(
        f"bootstrap_room {room} was dispatched to prefill DP rank {dp_rank}, but load_balance_method "
        f"follow_bootstrap_room implies rank {implied} (room % dp_size={dp_size}), where the decode looks for its KV; "
        f"set {FLAG}=1 on the prefill and decode servers to resolve the rank through the bootstrap registry, "
        f"or send disagg_prefill_dp_rank={dp_rank}"
    ))
