"""SmolLM2-135M (the real default model) against HF transformers on the same weights."""

import pytest
import torch

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
from disagg.engine.core import EngineCore
from disagg.types import SamplingParams
from engine_runs import run_requests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def prompts(tokenizer):
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    return [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):", chat)]


def run_all(core, prompt_ids, params):
    return run_requests(core, [(ids, params) for ids in prompt_ids])


@pytest.fixture(scope="module")
def hf32(smollm2_loaded):
    from hf_reference import hf_model_from_loaded

    return hf_model_from_loaded(smollm2_loaded, torch.float32)


def test_greedy_32_tokens_equal_hf_float32(smollm2_loaded, hf32):
    core = EngineCore(EngineConfig(model=ModelConfig(dtype="float32"), cache=CacheConfig(num_blocks=128)), smollm2_loaded)
    ids = prompts(smollm2_loaded.tokenizer)
    outs = run_all(core, ids, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for prompt, out in zip(ids, outs):
        ref = hf32.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.outputs.token_ids == ref[0, len(prompt):].tolist()
    assert outs[0].outputs.text.startswith(" Paris")


def prompt_logprobs_ours(loaded, dtype, ids, kv_cache_dtype="auto"):
    cache = CacheConfig(num_blocks=128, kv_cache_dtype=kv_cache_dtype)
    core = EngineCore(EngineConfig(model=ModelConfig(dtype=dtype), cache=cache), loaded)
    [out] = run_all(core, [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])


def prompt_logprobs_hf(hf, ids):
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return torch.tensor([ref[i - 1, ids[i]].item() for i in range(1, len(ids))])


def test_logits_within_stated_tolerance_of_hf(smollm2_loaded, hf32):
    """fp32: every prompt logprob within 1e-4 of HF fp32. bf16: its mean error against HF fp32 is
    within 25% of HF bf16's own mean error (bf16 rounding dominates; measured 0.079 vs 0.073).
    fp32 weights over a bf16 KV cache: within a quarter of HF bf16's mean error (measured 0.012)."""
    from hf_reference import hf_model_from_loaded

    ids = prompts(smollm2_loaded.tokenizer)[2]
    reference = prompt_logprobs_hf(hf32, ids)
    torch.testing.assert_close(prompt_logprobs_ours(smollm2_loaded, "float32", ids), reference, atol=1e-4, rtol=0)
    hf_bf16_error = (prompt_logprobs_hf(hf_model_from_loaded(smollm2_loaded, torch.bfloat16), ids) - reference).abs().mean()
    ours_bf16_error = (prompt_logprobs_ours(smollm2_loaded, "bfloat16", ids) - reference).abs().mean()
    assert ours_bf16_error <= 1.25 * hf_bf16_error
    bf16_cache_error = (prompt_logprobs_ours(smollm2_loaded, "float32", ids, "bfloat16") - reference).abs().mean()
    assert bf16_cache_error <= 0.25 * hf_bf16_error
