import pytest

from disagg.dp.aggregate import all_agree, all_true, check_results
from disagg.dp.dispatch import DP_CACHE_RULE, Dispatcher, routing_prompt
from disagg.dp.protocol import InconsistentUtilityResults, UtilityFailed
from disagg.types import InvalidRequest, SamplingParams
from disagg.wire.engine_msgs import GenerateMsg, UtilityResultMsg

ALIVE = [True, True, True]
SYSTEM = "You are a helpful assistant. Question: "  # 39 characters
BOTH = [True, True]


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


def test_cache_aware_balanced_loads_follow_the_longest_prefix_else_the_smallest_tree():
    d = Dispatcher("cache_aware", 2)
    assert d.pick(None, None, [0, 0], BOTH, SYSTEM + "one") == 0  # both trees empty: a miss, rank 0 on the tie
    assert d.pick(None, None, [0, 0], BOTH, SYSTEM + "two") == 0  # 39 of 42 symbols match: a hit
    assert (d.trees.size(0), d.trees.size(1)) == (42 + 3, 0)
    assert d.pick(None, None, [0, 0], BOTH, "Translate: bonjour") == 1  # no match: the smaller tree
    assert d.pick(None, None, [0, 0], BOTH, (1, 2, 3)) == 1  # token ids match no text: a miss, 18 < 45
    assert d.pick(None, None, [0, 0], BOTH, (1, 2, 3, 4)) == 1  # 3 of 4 ids: a hit
    assert (d.num_cache_hits, d.num_cache_misses) == (2, 3)


def test_cache_aware_imbalanced_loads_go_to_the_least_loaded():
    d = Dispatcher("cache_aware", 2)
    assert d.pick(None, None, [0, 0], BOTH, SYSTEM + "one") == 0
    # A gap within the thresholds (loads are estimated tokens here): the prefix still decides.
    assert d.pick(None, None, [DP_CACHE_RULE.balance_abs_threshold, 0], BOTH, SYSTEM + "two") == 0
    assert d.pick(None, None, [5000, 100], BOTH, SYSTEM + "three") == 1  # 4900 > 2048 and 5000 > 150
    assert (d.trees.size(1), d.num_cache_hits, d.num_cache_misses) == (44, 1, 2)


def test_cache_aware_never_picks_a_dead_worker_and_forgets_its_tree():
    d = Dispatcher("cache_aware", 2)
    assert d.pick(None, None, [0, 0], BOTH, SYSTEM + "one") == 0
    assert d.pick(None, None, [0, 0], [False, True], SYSTEM + "two") == 1  # rank 0 is down: its tree goes, rank 1 takes it (a miss)
    assert (d.trees.size(0), d.trees.size(1)) == (0, 42)
    assert d.pick(None, None, [0, 9999], [False, True], "x") == 1


def test_cache_aware_routed_rank_wins_and_counts_nothing():
    d = Dispatcher("cache_aware", 2)
    assert d.pick(None, None, [0, 0], BOTH, SYSTEM + "one") == 0
    assert d.pick(1, None, [0, 0], BOTH, SYSTEM + "two") == 1
    assert (d.trees.size(1), d.num_cache_hits, d.num_cache_misses) == (0, 0, 1)


def test_routing_prompt_is_the_text_else_the_ids_else_the_messages_joined():
    sampling = SamplingParams(max_tokens=1)
    assert routing_prompt(GenerateMsg("a", sampling, prompt="hi there")) == "hi there"
    assert routing_prompt(GenerateMsg("b", sampling, prompt_token_ids=[5, 6])) == (5, 6)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert routing_prompt(GenerateMsg("c", sampling, messages=messages)) == "be brief\nhi"
