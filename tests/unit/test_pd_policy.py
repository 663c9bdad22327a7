"""The pure P/D decisions: prefill room planning, decode rank resolution, which blocks may go out."""

import pytest

from decode.resolver import QUERY, decide_prefill_dp_rank
from disagg.types import InvalidRequest
from disagg.wire.bootstrap_msgs import TopologyMsg
from prefill.dispatch import RoomPlan, plan_room
from prefill.rooms import PrefillRoom


def plan(**kw):
    base = dict(dp_size=2, method="follow_bootstrap_room", dp_rank=1, room=7, decode_told=False, force_query=False)
    return plan_room(**{**base, **kw})


def test_plan_room():
    assert plan() == RoomPlan(register=False)  # 7 % 2 == 1: the decode finds it without asking
    assert plan(room=None) == RoomPlan(register=False)
    assert plan(dp_size=1, dp_rank=0) == RoomPlan(register=False)
    assert plan(method="round_robin", dp_rank=0) == RoomPlan(register=True)
    assert plan(method="least_load") == RoomPlan(register=True)
    assert plan(dp_rank=0, decode_told=True) == RoomPlan(register=False)
    assert plan(dp_rank=0, force_query=True) == RoomPlan(register=True)
    assert plan(force_query=True) == RoomPlan(register=True)  # the flag's decode always asks, even on the implied rank
    conflict = plan(dp_rank=0).conflict
    assert conflict.startswith("bootstrap_room 7 was dispatched to prefill DP rank 0, but load_balance_method "
                               "follow_bootstrap_room implies rank 1 (room % dp_size=2)")
    assert conflict.endswith("set DISAGG_FORCE_QUERY_PREFILL_DP_RANK=1 on the prefill and decode servers to resolve "
                             "the rank through the bootstrap registry, or send disagg_prefill_dp_rank=0")


def topo(dp_size=4, method="follow_bootstrap_room"):
    return TopologyMsg(dp_size=dp_size, load_balance_method=method)


def test_decode_resolution_order():
    assert decide_prefill_dp_rank(10, 3, topo(), force_query=True) == 3  # the request's field first
    assert decide_prefill_dp_rank(10, None, topo(dp_size=1), force_query=True) == 0
    assert decide_prefill_dp_rank(10, None, topo(), force_query=False) == 2  # 10 % 4, no round trip
    assert decide_prefill_dp_rank(10, None, topo(), force_query=True) == QUERY
    assert decide_prefill_dp_rank(10, None, topo(method="round_robin"), force_query=False) == QUERY
    with pytest.raises(InvalidRequest, match=r"^disagg_prefill_dp_rank 4 is not active \(prefill dp_size=4\)$"):
        decide_prefill_dp_rank(10, 4, topo(), force_query=False)


def test_blocks_go_out_as_chunks_complete():
    room = PrefillRoom(room=1, request_id="r", deadline=0.0)
    blocks = [5, 6, 7, 8]
    assert room.blocks_ready(blocks, num_computed_tokens=0, block_size=4, finished=False) == 0
    assert room.blocks_ready(blocks, num_computed_tokens=9, block_size=4, finished=False) == 2  # 2 full blocks
    assert room.blocks_ready(blocks, num_computed_tokens=13, block_size=4, finished=True) == 4  # the partial one too
