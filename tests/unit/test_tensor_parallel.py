"""Tensor parallelism in the engine (step one: the model split and its collectives): the shards put
back together are the weights, and N engine ranks, processes joined by gloo, generate exactly the
tokens one engine does (the tiny model: 4 query heads, 2 KV heads; TP 4 replicates each KV head)."""

import multiprocessing
from dataclasses import replace

import pytest
import torch

from disagg.config import ConfigError
from disagg.engine.core import EngineCore
from disagg.engine.models.arch import LlamaArch
from disagg.engine.models.tensor_parallel import HeadSplit, head_split, init_group, shard_arch, shard_weights
from disagg.engine.models.tiny import TINY_ARCH, build_tiny
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.types import SamplingParams
from engine_runs import run_requests
from kvtransfer.heads import rank_heads

pytestmark = pytest.mark.timeout(180)
TINY = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"), cache=CacheConfig(num_blocks=64, block_size=4),
                    scheduler=SchedulerConfig(max_num_batched_tokens=16))  # the long prompt is chunked
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(40, 77)), [9, 8, 7]]
A0 = "model.layers.0.self_attn."
M1 = "model.layers.1.mlp."


def test_the_shards_put_back_together_are_the_weights():
    weights = build_tiny(0).weights
    shards = [shard_weights(weights, TINY_ARCH, rank, 2) for rank in range(2)]
    for name, dim in ((A0 + "q_proj.weight", 0), (A0 + "k_proj.weight", 0), (A0 + "o_proj.weight", 1),
                      (M1 + "gate_proj.weight", 0), (M1 + "up_proj.weight", 0), (M1 + "down_proj.weight", 1),
                      ("lm_head.weight", 0)):
        assert torch.equal(torch.cat([s[name] for s in shards], dim), weights[name]), name
    assert torch.equal(shards[1]["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])  # whole
    assert shard_arch(TINY_ARCH, 1, 2) == replace(TINY_ARCH, num_heads=2, num_kv_heads=1, intermediate_size=64)


def test_more_ranks_than_kv_heads_replicate_them():
    assert [head_split(TINY_ARCH, rank, 4) for rank in range(4)] == [
        HeadSplit(0, 1, 0, 1), HeadSplit(1, 2, 0, 1), HeadSplit(2, 3, 1, 2), HeadSplit(3, 4, 1, 2)]
    weights = build_tiny(0).weights
    k = weights[A0 + "k_proj.weight"]
    assert torch.equal(shard_weights(weights, TINY_ARCH, 3, 4)[A0 + "k_proj.weight"], k[16:32])  # KV head 1
    assert torch.equal(shard_weights(weights, TINY_ARCH, 2, 4)[A0 + "k_proj.weight"], k[16:32])


def test_a_model_that_does_not_split_is_refused():
    smollm2 = LlamaArch(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                        num_kv_heads=3, head_dim=64)
    with pytest.raises(ConfigError) as err:
        shard_weights({}, smollm2, 0, 2)
    assert str(err.value) == ("tensor_parallel_size 2 does not fit this model: num_heads 9 is not a multiple of 2; "
                              "num_kv_heads 3 neither divides nor is divided by 2")


def test_the_transfer_layout_names_the_heads_the_engine_gives_each_rank():
    """kvtransfer/heads.py decides which heads a rank's cache holds without the engine: its rule
    must be the engine's split."""
    for kv_heads, size in [(2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (3, 3), (2, 8), (8, 2)]:
        arch = replace(TINY_ARCH, num_heads=8, num_kv_heads=kv_heads)
        for rank in range(size):
            split = head_split(arch, rank, size)
            assert rank_heads(kv_heads, size, rank) == (split.kv_start, split.kv_end), (kv_heads, size, rank)


def _rank(rank: int, size: int, init_file: str, results) -> None:
    torch.set_num_threads(1)
    group = init_group(rank, size, f"file://{init_file}")
    try:
        core = EngineCore(TINY, tp=group)
        outputs = run_requests(core, [(p, GREEDY) for p in PROMPTS])
        results.put((rank, [o.outputs.token_ids for o in outputs], core.runner.kv_cache.shape[4]))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_tp_ranks_generate_the_tokens_one_engine_does(size, tmp_path):
    expected = [o.outputs.token_ids for o in run_requests(EngineCore(TINY), [(p, GREEDY) for p in PROMPTS])]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(r, size, str(tmp_path / "rendezvous"), results)) for r in range(size)]
    for process in ranks:
        process.start()
    got = sorted(results.get(timeout=150) for _ in range(size))
    for process in ranks:
        process.join(30)
    assert [p.exitcode for p in ranks] == [0] * size
    assert [tokens for _, tokens, _ in got] == [expected] * size
    assert [kv_heads for _, _, kv_heads in got] == [2 // min(size, 2)] * size  # each rank caches its KV heads only
