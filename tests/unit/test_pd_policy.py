"""The pure P/D decisions: the rank rule (prefill room planning, decode rank resolution), which blocks may go out."""

import ast
import pathlib

import pytest

from disagg.rank_rule import RoomPlan, plan_room, resolve_prefill_rank
from disagg.types import InvalidRequest
from disagg.wire.control_msgs import TransferInfoMsg
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
    assert plan(dp_rank=0, implied_alive=False) == RoomPlan(register=True)  # rank 1 is down: placed on 0, registered
    conflict = plan(dp_rank=0).conflict
    assert conflict.startswith("bootstrap_room 7 was dispatched to prefill DP rank 0, but load_balance_method "
                               "follow_bootstrap_room implies rank 1 (room % dp_size=2)")
    assert conflict.endswith("set DISAGG_FORCE_QUERY_PREFILL_DP_RANK=1 on the prefill and decode servers to resolve "
                             "the rank through the bootstrap registry, or send disagg_prefill_dp_rank=0")


def resolve(requested, dp_size=4, method="follow_bootstrap_room", force_query=False):
    return resolve_prefill_rank(10, requested, dp_size=dp_size, method=method, force_query=force_query)


def test_decode_resolution_order():
    assert resolve(3, force_query=True) == 3  # the request's field first
    assert resolve(None, dp_size=1, force_query=True) == 0
    assert resolve(None) == 2  # 10 % 4, no round trip
    assert resolve(None, force_query=True) is None
    assert resolve(None, method="round_robin") is None
    with pytest.raises(InvalidRequest, match=r"^disagg_prefill_dp_rank 4 is not active \(prefill dp_size=4\)$"):
        resolve(4)


def test_the_rule_has_one_modulo_in_the_package():
    """The rank rule is defined once (rank_rule.implied_rank); every other place calls it."""
    root = pathlib.Path(__file__).resolve().parents[2]
    found = []
    for pkg in ("disagg", "prefill", "decode", "bootstrap", "kvtransfer"):
        for path in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and "dp_size" in ast.unparse(node.right):
                    home = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                            and f.lineno <= node.lineno <= f.end_lineno]
                    found.append(f"{path.relative_to(root)}:{'.'.join(home)}")
    assert found == ["disagg/rank_rule.py:implied_rank"]


def test_blocks_go_out_as_chunks_complete():
    room = PrefillRoom(room=1, request_id="r", deadline=0.0, block_size=4)
    blocks = [5, 6, 7, 8]
    assert room.blocks_ready(blocks, num_computed_tokens=0, finished=False) == 0
    assert room.blocks_ready(blocks, num_computed_tokens=9, finished=False) == 2  # 2 full blocks
    assert room.blocks_ready(blocks, num_computed_tokens=13, finished=True) == 4  # the partial one too


def test_blocks_the_decode_holds_are_never_sent():
    room = PrefillRoom(room=1, request_id="r", deadline=0.0, block_size=4)
    assert room.num_skipped_blocks == 0 and not room.all_sent  # no destination yet
    room.info = TransferInfoMsg(room=1, peer_name="d", dst_block_ids=(30, 31), num_prompt_tokens=13, num_cached_tokens=8)
    assert room.num_skipped_blocks == 2
    room.num_sent_blocks = 3
    assert not room.all_sent
    room.num_sent_blocks = 4  # 2 held by the decode + 2 written
    assert room.all_sent
