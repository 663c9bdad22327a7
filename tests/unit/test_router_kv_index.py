"""The router's KV-event index, pure: fed with the batches a real tiny engine's events become on the
wire, it matches a prompt's leading full blocks exactly as the engine's prefix cache would, and the
cache_aware prefill pick reads it once every (server, rank) has published."""

import random

import pytest

from disagg.worker.kv_events import to_wire
from disagg.engine.core import EngineCore
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.router import bodies
from disagg.router.cache_aware import CacheAwarePicker
from disagg.router.config import CacheAwareConfig
from disagg.router.kv_index import KVIndex
from disagg.router.policy import ServerLoad
from disagg.types import SamplingParams
from disagg.wire.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch

PROMPT = list(range(100, 118))  # 18 tokens: 4 full blocks of 4


def engine_batch(tiny_loaded, prompts, rank=0) -> KVEventBatch:
    config = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"), cache=CacheConfig(block_size=4, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    core = EngineCore(config, tiny_loaded)
    core.enable_kv_events()
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        while core.has_unfinished():
            core.step()
    return KVEventBatch(0.0, [to_wire(e, 4, "cpu") for e in core.take_kv_events()], rank)


def test_the_index_matches_what_the_engine_would_hit(tiny_loaded):
    index = KVIndex()
    assert not index.knows((0, 0)) and index.match_tokens((0, 0), PROMPT) == 0
    index.apply((0, 0), engine_batch(tiny_loaded, [PROMPT]))
    assert index.knows((0, 0)) and index.num_blocks((0, 0)) == 4
    assert index.match_tokens((0, 0), PROMPT) == 16
    assert index.match_tokens((0, 0), PROMPT[:9] + [1, 2, 3, 4, 5, 6, 7]) == 8  # blocks 0 and 1 shared
    assert index.match_tokens((0, 0), [7] + PROMPT) == 0  # no shared first block: nothing
    stored = index._blocks[(0, 0)]
    second = sorted(stored)[0]
    index.apply((0, 0), KVEventBatch(0.0, [BlockRemoved([second], "cpu")], 0))
    assert index.num_blocks((0, 0)) == 3
    index.apply((0, 0), KVEventBatch(0.0, [AllBlocksCleared()], 0))
    assert (index.knows((0, 0)), index.num_blocks((0, 0)), index.match_tokens((0, 0), PROMPT)) == (True, 0, 0)
    index.forget((0, 0))
    assert not index.knows((0, 0))


def two_ranks():
    return [ServerLoad(True, 0, server_id=0, dp_size=2)]


def test_the_prefill_pick_reads_the_index_once_every_rank_published(tiny_loaded):
    index = KVIndex()
    picker = CacheAwarePicker(CacheAwareConfig(), index)
    index.apply((0, 1), engine_batch(tiny_loaded, [PROMPT], rank=1))
    # Rank 0 has published nothing: the (empty) trees decide, a miss on rank 0.
    assert not picker.events_ready(two_ranks())
    assert (picker.pick(two_ranks(), "text", tuple(PROMPT)).dp_rank, picker.trees.size((0, 0))) == (0, 4)
    index.apply((0, 0), KVEventBatch(0.0, [], 0))
    assert picker.events_ready(two_ranks())
    # Now the index decides: rank 1 holds 16 of the 18 tokens (a hit), though the trees never saw it.
    pick = picker.pick(two_ranks(), "text", tuple(PROMPT))
    assert (pick.dp_rank, pick.outcome, pick.match_ratio) == (1, "hit", 16 / 18)
    assert picker.trees.size((0, 1)) == 4  # the text still goes into the chosen tree (the fallback)
    other = tuple(random.Random(0).randrange(200, 250) for _ in range(18))
    assert (picker.pick(two_ranks(), "other", other).outcome, picker.pick(two_ranks(), "x", None).outcome) == (
        "miss", "miss")  # nothing held: the smallest index (rank 0); no token ids: the trees


@pytest.mark.parametrize("path, body, expected", [
    ("/v1/completions", {"prompt": "Hi there", "max_tokens": 4}, {"prompt": "Hi there"}),
    ("/generate", {"text": "Hi"}, {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True},
     {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True}),
    ("/v1/chat/completions", {"messages": [], "chat_template_kwargs": {"x": 1}}, None),  # the worker's template differs
    ("/v1/completions", {"prompt": ["a", "b"]}, None),  # a batch
    ("/inference/v1/generate", {"token_ids": [1, 2]}, None),  # ids already
])
def test_the_tokenize_body_asks_for_the_prompt_as_the_worker_tokenizes_it(path, body, expected):
    assert bodies.tokenize_body(path, body) == expected
