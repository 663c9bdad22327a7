"""The engine on CUDA (the pure-torch ops: csrc's kernels are CPU only), on the tiny random model.
Skipped where torch sees no CUDA device; run them on a GPU machine with `pytest tests/gpu`."""

import pytest
import torch

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.core import EngineCore
from disagg.types import SamplingParams
from engine_runs import run_requests

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["Hello, world", "The quick brown fox jumps over the lazy dog. " * 3, "a", "0123456789", "Paged attention!"]


def engine(loaded, device=DEVICE, dtype="float32", budget=512):
    config = EngineConfig(
        model=ModelConfig(model="tiny", dtype=dtype, device=device, kernels="auto"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget),
    )
    return EngineCore(config, loaded)


def tokens(core, prompts, params=GREEDY):
    outs = run_requests(core, [(core.tokenizer.encode(p), params) for p in prompts])
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs.token_ids for o in outs]


def test_greedy_on_cuda_equals_hf_on_cuda(tiny_loaded):
    from hf_reference import hf_model_from_loaded

    core = engine(tiny_loaded, budget=24)  # chunked prefill beside decodes
    assert core.runner.model.ops.name == "torch"
    assert (core.runner.kv_cache.device.type, core.runner.kv_cache.dtype) == (DEVICE, torch.float32)
    hf = hf_model_from_loaded(tiny_loaded, torch.float32).to(DEVICE)
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([core.tokenizer.encode(prompt)], device=DEVICE)
        out = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, ids.shape[1]:].tolist())
    assert tokens(core, PROMPTS) == expected


def test_seeded_sampling_on_cuda_draws_the_cpu_engines_tokens(tiny_loaded):
    """The sampler's generators are CPU ones; a CUDA row is drawn on the CPU, so a seed gives the
    tokens it gives on the CPU (and no request fails on a generator of the wrong device)."""
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    on_cuda = tokens(engine(tiny_loaded), PROMPTS, params)
    on_cpu = tokens(engine(tiny_loaded, device="cpu"), PROMPTS, params)
    assert on_cuda == on_cpu
    assert len({tuple(t) for t in on_cuda}) == len(PROMPTS)


def test_auto_dtype_on_cuda_is_native_and_a_prefix_hit_gives_the_same_tokens(tiny_loaded):
    core = engine(tiny_loaded, dtype="auto")
    native = torch.cuda.is_bf16_supported(including_emulation=False) if DEVICE == "cuda" else True
    assert (core.runner.kv_cache.device.type, core.runner.kv_cache.dtype) == (
        DEVICE, torch.bfloat16 if native else torch.float16)
    prefix = list(range(40, 60))  # 20 tokens = 5 full blocks of 4
    [first] = run_requests(core, [(prefix + [1, 2, 3], GREEDY)])
    [second] = run_requests(core, [(prefix + [7, 8], GREEDY)])
    [fresh] = run_requests(engine(tiny_loaded, dtype="auto"), [(prefix + [7, 8], GREEDY)])
    assert (first.num_cached_tokens, second.num_cached_tokens, fresh.num_cached_tokens) == (0, 20, 0)
    assert second.outputs.token_ids == fresh.outputs.token_ids and len(second.outputs.token_ids) == 16
    core.kv.pool.check_integrity()


def test_sleep_level_1_frees_the_cache_and_the_device_weights_and_wake_gives_the_same_tokens(tiny_loaded):
    """On CUDA, level 1 drops the KV cache and the device's weights (the engine's host copy stays)
    and hands the memory back to the device; wake_up moves the weights back."""
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    core = engine(tiny_loaded)
    before = tokens(core, PROMPTS)
    assert torch.cuda.memory_allocated() > baseline
    core.sleep(1)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline
    assert core.runner.model is None and core.loaded is tiny_loaded  # no reload from disk on wake
    core.wake_up()
    assert core.runner.kv_cache.device.type == DEVICE
    assert tokens(core, PROMPTS) == before
