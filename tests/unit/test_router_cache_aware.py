"""`--policy cache_aware`, pure: the radix tree (exact sizes and match lengths, LRU eviction), the
prefill pick (imbalanced, hit, miss) and the decode's power of two choices with a seeded RNG."""

import random

import pytest

from disagg.cli import build_parser
from disagg.config import ConfigError
from disagg.router import bodies
from disagg.router.cache_aware import (
    CacheAwarePairPicker, CacheAwarePicker, CacheOutcome, PrefillPick, PrefixTrees, is_imbalanced, pick_power_of_two,
)
from disagg.router.config import CacheAwareConfig
from disagg.router.errors import NoHealthyServer
from disagg.router.launch import config_from_args
from disagg.router.policy import PairPick, PairPicker, Policy, ServerLoad
from disagg.prefix_tree import RadixTree, as_prompt

CONFIG = CacheAwareConfig()  # sglang-router's thresholds: 0.3, 64, 1.5


def two_servers(in_flight=(0, 0), dp_size=2, eligible=(True, True)) -> list[ServerLoad]:
    return [ServerLoad(ok, n, server_id=i, dp_size=dp_size) for i, (ok, n) in enumerate(zip(eligible, in_flight))]


# --- the radix tree ---------------------------------------------------------------------------------


def test_tree_inserts_splits_and_matches_prefixes():
    tree = RadixTree()
    tree.insert("hello world", 1)
    tree.insert("hello there", 2)
    assert tree.size == len("hello world") + len("there")
    assert [tree.match_length(t) for t in ("hello thing", "help", "hello world!", "xyz", "")] == [8, 3, 11, 0, 0]
    tree.insert("hello", 3)  # already held: nothing added
    assert tree.size == 16


def test_token_ids_are_symbols_of_their_own():
    tree = RadixTree()
    tree.insert(as_prompt([1, 2, 3, 4]), 1)
    assert tree.match_length((1, 2, 9)) == 2
    assert tree.match_length("\x01\x02") == 0  # characters never equal ids
    tree.insert("ab", 2)
    assert (tree.size, tree.match_length("abc"), tree.match_length((1, 2, 3, 4, 5))) == (6, 2, 4)


def test_eviction_drops_least_recently_used_leaves_to_the_bound():
    tree = RadixTree()
    tree.insert("aaaa", 1)
    tree.insert("bbbb", 2)
    tree.insert("aacc", 3)  # "aa" is split: aa -> {aa (tick 1), cc (tick 3)}
    assert tree.size == 10
    assert tree.evict_to(10) == 0
    assert tree.evict_to(8) == 2  # the "aa" leaf of tick 1
    assert [tree.match_length(t) for t in ("aaaa", "bbbb", "aacc")] == [2, 4, 4]
    assert tree.evict_to(4) == 4  # then "bbbb" (tick 2), before "cc" (tick 3)
    assert [tree.match_length(t) for t in ("aaaa", "bbbb", "aacc")] == [2, 0, 4]
    assert tree.evict_to(0) == 4  # "cc", then its parent "aa", now a leaf
    assert (tree.size, tree.match_length("aacc")) == (0, 0)


def test_a_use_refreshes_a_prefix_so_its_leaf_outlives_older_ones():
    tree = RadixTree()
    tree.insert("xxxx", 1)
    tree.insert("yyyy", 2)
    tree.insert("xxxx", 3)
    assert tree.evict_to(4) == 4
    assert (tree.match_length("xxxx"), tree.match_length("yyyy")) == (4, 0)


def test_each_tenant_is_bounded_on_its_own_and_forgotten_with_its_server():
    trees = PrefixTrees(max_tree_size=6)
    trees.insert((0, 0), "abcdef")
    trees.insert((0, 1), "xyz")
    trees.insert((0, 0), "ghij")  # 10 > 6: "abcdef" (older) goes
    assert [trees.size(t) for t in ((0, 0), (0, 1), (1, 0))] == [4, 3, 0]
    assert (trees.match_length((0, 0), "abc"), trees.match_length((0, 0), "ghij")) == (0, 4)
    trees.keep_servers({1})
    assert [trees.size(t) for t in ((0, 0), (0, 1))] == [0, 0]


# --- the prefill pick -------------------------------------------------------------------------------


@pytest.mark.parametrize("in_flight, expected", [
    ((100, 10), True), ((70, 0), True), ((130, 65), True),
    ((100, 36), False),  # a gap of 64 is not more than 64
    ((200, 135), False),  # a gap of 65, but 200 is not more than 1.5 * 135
    ((5,), False),
])
def test_imbalance_needs_both_gaps(in_flight, expected):
    assert is_imbalanced(in_flight, CONFIG) is expected


def test_imbalanced_goes_to_the_shortest_queue_and_its_smallest_rank():
    picker = CacheAwarePicker(CONFIG)
    picker.trees.insert((0, 0), "shared prefix")
    picker.trees.insert((1, 0), "0123456789")
    pick = picker.pick(two_servers((100, 10)), "shared prefix, again")
    assert pick == PrefillPick(1, 1, CacheOutcome.IMBALANCED, 0.0)
    assert picker.trees.size((1, 1)) == len("shared prefix, again")  # inserted there all the same


def test_balanced_hit_above_the_threshold_follows_the_tree_and_a_miss_takes_the_smallest():
    picker = CacheAwarePicker(CONFIG)
    loads = two_servers((3, 0))  # a gap of 3: balanced
    assert picker.pick(loads, "abcdefghij") == PrefillPick(0, 0, CacheOutcome.MISS, 0.0)  # all empty: the first
    assert picker.pick(loads, "abcdefghXY") == PrefillPick(0, 0, CacheOutcome.HIT, 0.8)
    assert picker.pick(loads, "zzzz") == PrefillPick(0, 1, CacheOutcome.MISS, 0.0)  # (0, 0) holds 12 symbols
    assert picker.pick(loads, "qqqq") == PrefillPick(1, 0, CacheOutcome.MISS, 0.0)
    assert picker.pick(loads, "zzzzzz") == PrefillPick(0, 1, CacheOutcome.HIT, 4 / 6)
    assert picker.pick(loads, "abcXXXXXXX") == PrefillPick(1, 1, CacheOutcome.MISS, 0.3)  # 0.3 is not above 0.3


def test_ineligible_servers_unknown_dp_size_and_empty_prompts():
    picker = CacheAwarePicker(CONFIG)
    assert picker.pick(two_servers(eligible=(False, False)), "abc") is None
    picker.trees.insert((0, 0), "abcdef")
    loads = [ServerLoad(False, 0, 0, 2), ServerLoad(True, 0, 7, None)]
    assert picker.pick(loads, "abcdef") == PrefillPick(1, None, CacheOutcome.MISS, 0.0)  # no rank to pin
    assert picker.pick(loads, "abcdef") == PrefillPick(1, None, CacheOutcome.HIT, 1.0)  # tenant (7, 0)
    assert picker.pick(loads, "") == PrefillPick(1, None, CacheOutcome.MISS, 0.0)
    assert picker.trees.size((7, 0)) == 6


# --- the pair ---------------------------------------------------------------------------------------


def test_power_of_two_takes_the_less_loaded_of_two_random_servers():
    loads = [ServerLoad(True, n) for n in (5, 3, 1)]
    rng = random.Random(0)  # draws (1, 2), (0, 1), (2, 1), (1, 2)
    assert [pick_power_of_two(loads, rng) for _ in range(4)] == [2, 1, 2, 2]
    rng = random.Random(0)
    assert [pick_power_of_two([ServerLoad(True)] * 3, rng) for _ in range(4)] == [1, 0, 2, 1]  # ties: the first drawn
    assert pick_power_of_two([ServerLoad(False), ServerLoad(True, 9)], rng) == 1
    assert pick_power_of_two([ServerLoad(False)], rng) is None


def test_pair_picker_pins_the_prefill_rank_and_names_the_role_without_servers():
    picker = CacheAwarePairPicker(CONFIG, random.Random(0))
    decode = [ServerLoad(True, n) for n in (5, 3, 1)]
    assert picker.pick(two_servers(), decode, "hello") == PairPick(0, 2, 0, "miss", 0.0)
    assert picker.pick(two_servers(), decode, "hello you") == PairPick(0, 1, 0, "hit", 5 / 9)
    with pytest.raises(NoHealthyServer, match="prefill"):
        picker.pick(two_servers(eligible=(False, False)), decode, "hello")
    with pytest.raises(NoHealthyServer, match="decode"):
        picker.pick(two_servers(), [ServerLoad(False)], "never inserted")
    assert picker.prefill.trees.size((0, 0)) == len("hello you")
    with pytest.raises(ValueError, match="CacheAwarePairPicker"):
        PairPicker(Policy.CACHE_AWARE)


def test_a_decode_holding_the_prefix_prefills_a_short_rest_itself():
    picker = CacheAwarePairPicker(CacheAwareConfig(local_prefill_min_prefill_load=0), random.Random(0))
    # Each decode's limit, as the router read it from its /server_info.
    decodes = [ServerLoad(True, 0, server_id=7, max_local_prefill_tokens=4),
               ServerLoad(True, 0, server_id=8, max_local_prefill_tokens=4)]
    first = "You are a helpful assistant. Hi"  # 31 characters
    # Every tree is empty: a miss on both sides; the decode with the smallest tree (the first) gets it.
    assert picker.pick(two_servers(), decodes, first) == PairPick(0, 0, 0, "miss", 0.0)
    # The first decode's tree holds 31 of 47 characters; the other 16 are 4 tokens: the decode alone.
    second = first + " How are you, my"
    assert picker.pick(two_servers(), decodes, second) == PairPick(None, 0)
    # 17 characters past what the decode holds are 5 tokens: with a prefill (whose tree holds `first`).
    third = second + " friend, tell me!"
    assert picker.pick(two_servers(), decodes, third) == PairPick(0, 0, 0, "hit", 31 / 64)
    # A refused local prefill comes back with local_ok=False: a prefill whatever the decode holds.
    assert picker.pick(two_servers(), decodes, third + "?", local_ok=False) == PairPick(0, 0, 0, "hit", 64 / 65)
    assert (picker.decode.trees.size((7, 0)), picker.decode.trees.size((8, 0))) == (65, 0)
    assert picker.prefill.trees.size((0, 0)) == 65  # the local pick inserted nothing into the prefill trees
    # Token ids count exactly: 4 ids past the decode's tree go alone, a fifth does not.
    ids = tuple(range(100, 120))
    assert picker.pick(two_servers(), decodes, ids).local is False  # ids share nothing with text: a miss
    assert picker.pick(two_servers(), decodes, ids + (1, 2, 3, 4)) == PairPick(None, 1)
    assert picker.pick(two_servers(), decodes, ids + (1, 2, 3, 4, 5, 6, 7, 8, 9)).local is False


def test_a_short_rest_goes_to_the_decode_alone_only_while_every_prefill_is_busy():
    config = CacheAwareConfig(local_prefill_min_prefill_load=2)
    picker = CacheAwarePairPicker(config, random.Random(0))
    decodes = [ServerLoad(True, 0, server_id=7, max_local_prefill_tokens=4)]
    first = "You are a helpful assistant. Hi"
    picker.pick(two_servers(), decodes, first)

    def prefills(*prefilling: int, eligible: tuple[bool, ...] = (True, True)) -> list[ServerLoad]:
        return [ServerLoad(ok, 9, i, 1, n) for i, (ok, n) in enumerate(zip(eligible, prefilling))]

    # 4 tokens past the decode's tree, but one prefill has only one leg unanswered: it computes them.
    assert picker.pick(prefills(2, 1), decodes, first + " How").local is False
    assert picker.pick(prefills(2, 2), decodes, first + " How are").local is True
    # An ineligible prefill's queue does not count; requests in flight (decoding) do not either.
    assert picker.pick(prefills(0, 3, eligible=(False, True)), decodes, first + " How are you").local is True
    assert picker.pick([ServerLoad(True, 50, 0, 1, 1)], decodes, first + " How are you,").local is False


def test_without_local_prefill_the_decode_is_drawn_by_power_of_two():
    picker = CacheAwarePairPicker(CONFIG, random.Random(0))
    decodes = [ServerLoad(True, n, server_id=n) for n in (5, 3, 1)]
    assert picker.pick(two_servers(), decodes, "hello").local is False
    picker.learn_answer(3, "hello world")  # no decode prefills itself: nothing is learned
    assert [picker.decode.trees.size((n, 0)) for n in (5, 3, 1)] == [0, 0, 0]


def test_each_decode_goes_by_its_own_limit():
    """The limit is each decode's own (its --max-local-prefill-tokens, from its /server_info): a decode
    with none never gets a request alone, whatever its tree holds."""
    picker = CacheAwarePairPicker(CacheAwareConfig(local_prefill_min_prefill_load=0), random.Random(0))
    first = "You are a helpful assistant. Hi"
    decodes = [ServerLoad(True, 0, server_id=7, max_local_prefill_tokens=0),
               ServerLoad(True, 0, server_id=8, max_local_prefill_tokens=8)]
    assert picker.pick(two_servers(), decodes, first) == PairPick(0, 0, 0, "miss", 0.0)  # smallest tree: the first
    picker.learn_answer(7, first)
    # The first decode holds the prefix but prefills nothing itself; 4 tokens past it go with a prefill.
    assert picker.pick(two_servers(), decodes, first + " How are you, my") == PairPick(0, 0, 0, "hit", 31 / 47)
    assert picker.decode.trees.size((7, 0)) == 47  # the pick inserted the prompt; learn_answer added nothing
    picker.pick(two_servers(), decodes[::-1], "Hello there, who are you")  # the second decode gets a miss
    assert picker.pick(two_servers(), decodes[::-1], "Hello there, who are you, my friend?") == PairPick(None, 0)


def test_with_no_prefill_serving_a_decode_that_prefills_locally_takes_the_whole_prompt():
    """No eligible prefill (the planner moved the last one to decode, or it is down): the decodes that
    prefill locally take every request whole, by the same cache-aware pick (a conversation stays where
    its prefix is); a decode that prefills nothing itself never does, and without one it is a 503."""
    picker = CacheAwarePairPicker(CacheAwareConfig(local_prefill_min_prefill_load=0), random.Random(0))
    none_serving = two_servers(eligible=(False, False))
    decodes = [ServerLoad(True, 0, server_id=7, max_local_prefill_tokens=0),
               ServerLoad(True, 0, server_id=8, max_local_prefill_tokens=8),
               ServerLoad(True, 0, server_id=9, max_local_prefill_tokens=8)]
    long_prompt = "You are a helpful assistant. " * 20  # 580 characters: far past any limit
    assert picker.pick(none_serving, decodes, long_prompt) == PairPick(None, 1, whole=True)
    assert picker.pick(none_serving, decodes, "Something else entirely") == PairPick(None, 2, whole=True)
    assert picker.pick(none_serving, decodes, long_prompt + "And now?") == PairPick(None, 1, whole=True)
    assert picker.pick(none_serving, decodes, long_prompt + "Again", local_ok=False) == PairPick(None, 1, whole=True)
    assert [picker.decode.trees.size((n, 0)) for n in (7, 8, 9)] == [0, len(long_prompt) + len("And now?") + len("gain"), 23]  # "Again" shares its A
    # The prefill serving again: a long rest goes with it.
    assert picker.pick(two_servers(), decodes, long_prompt + "And then?").whole is False
    with pytest.raises(NoHealthyServer, match="prefill"):
        picker.pick(none_serving, decodes[:1], long_prompt)
    with pytest.raises(NoHealthyServer, match="prefill"):
        picker.pick(none_serving, [ServerLoad(False, 0, server_id=8, max_local_prefill_tokens=8)], long_prompt)


def test_the_flags_are_sglang_routers():
    base = ["router", "--prefill", "http://p:1", "--decode", "http://d:2"]
    assert config_from_args(build_parser().parse_args(base)).cache_aware == CacheAwareConfig(0.3, 64, 1.5, 2**22)
    config = config_from_args(build_parser().parse_args([
        *base, "--policy", "cache_aware", "--cache-threshold", "0.5", "--balance-abs-threshold", "32",
        "--balance-rel-threshold", "2", "--max-tree-size", "1000"]))
    assert (config.policy, config.cache_aware) == (Policy.CACHE_AWARE, CacheAwareConfig(0.5, 32, 2.0, 1000))


def test_config_checks_its_bounds():
    for bad, message in [({"cache_threshold": 1.5}, "--cache-threshold"), ({"balance_abs_threshold": -1}, "abs"),
                         ({"local_prefill_min_prefill_load": -1},
                          "--local-prefill-min-prefill-load must be >= 0, got -1"),
                         ({"balance_rel_threshold": 0.5}, "rel"), ({"max_tree_size": 0}, "--max-tree-size")]:
        with pytest.raises(ConfigError, match=message):
            CacheAwareConfig(**bad)
    with pytest.raises(ConfigError) as exc:
        CacheAwareConfig(prefill_kv_events=("http://p:5557",))
    assert str(exc.value) == "--prefill-kv-events takes tcp://HOST:PORT or ipc:// endpoints, got 'http://p:5557'"
    base = ["router", "--prefill", "http://p:1", "--prefill", "http://q:1", "--decode", "http://d:2"]
    config = config_from_args(build_parser().parse_args([*base, "--policy", "cache_aware", "--prefill-kv-events",
                                                         "tcp://p:5557,ipc:///run/q"]))
    assert config.cache_aware.prefill_kv_events == ("tcp://p:5557", "ipc:///run/q")
    for extra in (["--policy", "cache_aware", "--prefill-kv-events", "tcp://p:5557"], ["--prefill-kv-events", "tcp://p:1,tcp://q:1"]):
        with pytest.raises(ConfigError) as exc:
            config_from_args(build_parser().parse_args([*base, *extra]))
        assert str(exc.value).startswith("--prefill-kv-events needs --policy cache_aware and one endpoint per --prefill (2), got")


# --- what is matched --------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, expected", [
    ("/v1/completions", {"prompt": "once upon"}, "once upon"),
    ("/v1/completions", {"prompt": [7, 8, 9]}, (7, 8, 9)),
    ("/v1/completions", {"prompt": ["a b", "c"]}, "a b c"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                        {"type": "image_url", "image_url": {}}]}]},
     "be brief hi"),
    ("/generate", {"text": "abc"}, "abc"),
    ("/generate", {"input_ids": [[1, 2], [3]]}, (1, 2, 3)),
    ("/inference/v1/generate", {"token_ids": [4, 5]}, (4, 5)),
    ("/inference/v1/generate", {"token_ids": [4, True]}, ""),
    ("/v1/chat/completions", {"messages": "not a list"}, ""),
    ("/v1/completions", {"prompt": [{"x": 1}]}, ""),
])
def test_routing_text_is_what_sglang_router_matches(path, body, expected):
    assert bodies.routing_text(path, body) == expected


def test_a_pinned_prefill_rank_goes_on_both_legs_and_the_decode_picks_its_own():
    prefill, decode = bodies.with_dp_ranks({"text": "x"}, 1, None)
    assert prefill == {"text": "x", "routed_dp_rank": 1, "disagg_prefill_dp_rank": 1}
    assert decode == {"text": "x", "disagg_prefill_dp_rank": 1}
