import pytest

from disagg.dp.aggregate import all_agree, all_true, check_results
from disagg.dp.dispatch import Dispatcher
from disagg.dp.protocol import InconsistentUtilityResults, UtilityFailed
from disagg.types import InvalidRequest
from disagg.wire.engine_msgs import UtilityResultMsg

ALIVE = [True, True, True]


def test_round_robin_cycles_over_live_workers():
    d = Dispatcher("round_robin", 3)
    assert [d.pick(None, None, [0, 0, 0], ALIVE) for _ in range(4)] == [0, 1, 2, 0]
    assert [d.pick(None, None, [0, 0, 0], [True, False, True]) for _ in range(3)] == [0, 2, 0]


def test_least_load_picks_fewest_outstanding_tokens_lowest_rank_on_ties():
    d = Dispatcher("least_load", 3)
    assert d.pick(None, None, [30, 10, 10], ALIVE) == 1
    assert d.pick(None, None, [30, 10, 5], [True, True, False]) == 1


def test_follow_bootstrap_room_uses_room_modulo_else_the_least_loaded():
    d = Dispatcher("follow_bootstrap_room", 3)
    assert d.pick(None, 7, [0, 0, 0], ALIVE) == 1
    assert d.pick(None, 2**62 + 2, [0, 0, 0], ALIVE) == (2**62 + 2) % 3
    # No room (a pull-flow request): the least loaded live worker.
    assert d.pick(None, None, [9, 4, 7], ALIVE) == 1
    assert d.pick(None, None, [9, 4, 7], [True, False, True]) == 2


@pytest.mark.parametrize("rank", [-1, 3, True, "1"])
def test_routed_rank_wins_and_bad_ranks_are_rejected(rank):
    d = Dispatcher("follow_bootstrap_room", 3)
    assert d.pick(2, 7, [0, 0, 0], ALIVE) == 2
    with pytest.raises(InvalidRequest) as err:
        d.pick(rank, 7, [0, 0, 0], ALIVE)
    assert str(err.value) == f"DP rank {rank} is not active (dp_size=3)"


def test_aggregation():
    ok = [UtilityResultMsg(0, result=True), UtilityResultMsg(1, result=True)]
    assert check_results("reset_prefix_cache", ok) == [True, True]
    with pytest.raises(UtilityFailed, match=r"^sleep failed on 1 DP worker\(s\) \(dp_rank 1: boom\)$"):
        check_results("sleep", [UtilityResultMsg(0, result=None), UtilityResultMsg(1, error="boom")])
    with pytest.raises(UtilityFailed, match="^is_sleeping: there are no DP workers$"):
        check_results("is_sleeping", [])
    assert all_agree("is_sleeping", [False, False]) is False
    with pytest.raises(InconsistentUtilityResults, match=r"^is_sleeping: DP workers disagree \(dp_rank 0: True, dp_rank 1: False\)$"):
        all_agree("is_sleeping", [True, False])
    with pytest.raises(UtilityFailed, match=r"^reset_prefix_cache failed on 1 DP worker\(s\) \(dp_rank 0: returned False\)$"):
        all_true("reset_prefix_cache", [False, True])


def test_follow_bootstrap_room_places_a_room_whose_rank_is_down_on_the_least_loaded_live_rank():
    d = Dispatcher("follow_bootstrap_room", 3)
    assert d.pick(None, 7, [5, 9, 2], [True, False, True]) == 2  # 7 % 3 = 1 is down
    assert d.pick(None, 7, [5, 9, 2], [False, False, False]) == 1  # none alive: the rule's rank (it answers 503)
