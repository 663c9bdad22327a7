"""The engine on the tiny random model, checked against HF transformers and against itself."""

import pytest
import torch

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.core import EngineCore
from disagg.engine.llm import LLM
from disagg.types import EngineSleeping, FinishReason, InvalidRequest, SamplingParams
from engine_runs import run_requests
from kernel_summary import huge_pages

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = ["Hello, world", "The quick brown fox jumps over the lazy dog. " * 3, "a", "0123456789", "Paged attention!"]


def engine(loaded, num_blocks=256, block_size=4, budget=512, max_seqs=32, caching=True, dtype="float32", kernels="auto",
           kv_cache_dtype="auto"):
    config = EngineConfig(
        model=ModelConfig(model="tiny", dtype=dtype, kernels=kernels),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=caching,
                          kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
    )
    return EngineCore(config, loaded)


def run(core, prompts, params=GREEDY):
    return run_requests(core, [(core.tokenizer.encode(p) if isinstance(p, str) else p, params) for p in prompts])


@pytest.fixture(scope="module")
def hf_tiny(tiny_loaded):
    from hf_reference import hf_model_from_loaded

    return hf_model_from_loaded(tiny_loaded, torch.float32)


def hf_greedy(hf, token_ids, n=16):
    out = hf.generate(torch.tensor([token_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


@pytest.mark.parametrize("kernels", ["csrc", "torch"])
def test_greedy_matches_hf_batched_and_one_at_a_time(tiny_loaded, hf_tiny, kernels):
    core = engine(tiny_loaded, kernels=kernels)
    assert core.runner.model.ops.name.startswith(kernels)
    encoded = [core.tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(hf_tiny, ids) for ids in encoded]
    assert len({tuple(e) for e in expected}) == len(PROMPTS)  # the tiny model is not degenerate
    batched = [o.outputs.token_ids for o in run(core, PROMPTS)]
    single = [run(engine(tiny_loaded, kernels=kernels), [p])[0].outputs.token_ids for p in PROMPTS]
    assert batched == expected
    assert single == expected


def test_bfloat16_kernels_give_the_torch_ops_tokens(tiny_loaded):
    # RoPE and the cache write round exactly as torch does; attention and norms sum in another order,
    # which bfloat16 rounding hides on these prompts (mixed decode + chunked prefill batches included).
    ours = [o.outputs.token_ids for o in run(engine(tiny_loaded, dtype="bfloat16", kernels="csrc", budget=24), PROMPTS)]
    ref = [o.outputs.token_ids for o in run(engine(tiny_loaded, dtype="bfloat16", kernels="torch", budget=24), PROMPTS)]
    assert ours == ref


def _wide_heads(tiny_loaded):
    """The tiny model with 64-wide heads, 3 query heads per KV head: csrc's fixed-size decode
    attention and its paged prefill attention take it."""
    import dataclasses

    from disagg.engine.models.tiny import TINY_ARCH, random_weights

    arch = dataclasses.replace(TINY_ARCH, num_heads=6, num_kv_heads=2, head_dim=64)
    return dataclasses.replace(tiny_loaded, arch=arch, weights=random_weights(arch, seed=3))


@pytest.mark.parametrize("wide", [False, True], ids=["head_dim16", "head_dim64"])
def test_a_bfloat16_cache_under_float32_gives_the_torch_ops_tokens(tiny_loaded, wide):
    """--kv-cache-dtype bfloat16: csrc's kernels read the bfloat16 cache as the torch ops do, through
    mixed decode + chunked prefill batches and a prefix hit; the cache is bfloat16, again after a sleep."""
    model = _wide_heads(tiny_loaded) if wide else tiny_loaded
    ours = engine(model, budget=7, kernels="csrc", kv_cache_dtype="bfloat16")
    ref = engine(model, budget=7, kernels="torch", kv_cache_dtype="bfloat16")
    assert ours.runner.model._csrc_prefill == wide
    assert ours.runner.kv_cache.dtype == torch.bfloat16 and ours.cache_spec().dtype == "bfloat16"
    tokens = [[o.outputs.token_ids for o in run(core, PROMPTS)] for core in (ours, ref)]
    assert tokens[0] == tokens[1]
    [hit] = run(ours, [PROMPTS[1]])
    assert (hit.num_cached_tokens, hit.outputs.token_ids) == (132, tokens[1][1])  # 33 of its 34 blocks
    ours.sleep(1)
    ours.wake_up()
    assert ours.runner.kv_cache.dtype == torch.bfloat16
    assert [o.outputs.token_ids for o in run(ours, PROMPTS[2:])] == tokens[1][2:]


def test_a_prompt_in_one_chunk_reads_its_keys_as_a_bfloat16_cache_holds_them(tiny_loaded):
    """The torch path's first chunk attends to its own keys rounded through the cache, as every later
    chunk reads them from it: one chunk and chunks of 7 agree within 1e-5 (measured 1.9e-6; with the
    first chunk's keys unrounded, 0.019)."""
    ids = list(range(100, 137))
    scored = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    logprobs = []
    for budget in (512, 7):
        core = engine(tiny_loaded, budget=budget, kernels="torch", caching=False, kv_cache_dtype="bfloat16")
        [out] = run(core, [ids], scored)
        logprobs.append(torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))]))
    torch.testing.assert_close(logprobs[0], logprobs[1], atol=1e-5, rtol=0)


def test_a_bfloat16_cache_holds_twice_the_blocks_in_the_same_memory(tiny_loaded):
    """A block of the tiny model (2 layers x K and V x 4 tokens x 2 heads x 16) is 2048 bytes in float32,
    1024 in bfloat16: 1 MiB holds 512 and 1024."""
    def blocks(kv_cache_dtype):
        return EngineCore(EngineConfig(model=ModelConfig(model="tiny", dtype="float32"),
                                       cache=CacheConfig(block_size=4, kv_cache_memory_mib=1,
                                                         kv_cache_dtype=kv_cache_dtype)), tiny_loaded)

    auto, bf16 = blocks("auto"), blocks("bfloat16")
    assert (auto.num_blocks, bf16.num_blocks) == (512, 1024)
    assert (auto.runner.kv_cache.nbytes, bf16.runner.kv_cache.nbytes) == (2**20, 2**20)
    assert auto.engine_summary.endswith(", kv cache float32 (auto: the model's dtype)" + huge_pages(auto))
    assert bf16.engine_summary.endswith(", kv cache bfloat16 (set by --kv-cache-dtype)" + huge_pages(bf16))


def test_the_kv_cache_dtype_resolves_against_the_model_dtype():
    from disagg.config import ConfigError
    from disagg.engine_config import KVCacheDType
    from disagg.engine.resolve import resolve_kv_cache_dtype

    assert resolve_kv_cache_dtype(KVCacheDType.AUTO, torch.float32) == torch.float32
    assert resolve_kv_cache_dtype(KVCacheDType.AUTO, torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype(KVCacheDType.BFLOAT16, torch.float32) == torch.bfloat16
    assert resolve_kv_cache_dtype(KVCacheDType.BFLOAT16, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ConfigError, match="^kv_cache_dtype bfloat16 takes a float32 or bfloat16 model, not float16$"):
        EngineConfig(model=ModelConfig(dtype="float16", device="cuda"), cache=CacheConfig(kv_cache_dtype="bfloat16"))
    with pytest.raises(ConfigError, match="^kv_cache_dtype must be one of auto, bfloat16, got 'fp8'$"):
        CacheConfig(kv_cache_dtype="fp8")


@pytest.mark.parametrize("native,dtype,why", [(True, torch.bfloat16, "auto: native bf16 on this GPU"),
                                               (False, torch.float16, "auto: no native bf16 on this GPU")])
def test_auto_dtype_on_a_gpu_is_bfloat16_only_where_it_is_native(monkeypatch, native, dtype, why):
    """Pre-Ampere GPUs emulate bfloat16: auto takes float16 there (no CUDA here: the probe is replaced)."""
    from disagg.config import ConfigError
    from disagg.engine import resolve
    from disagg.engine_config import KVCacheDType

    monkeypatch.setattr(resolve, "_cuda_has_native_bf16", lambda device: native)
    assert (resolve.resolve_dtype("auto", "cuda:1"), resolve.dtype_reason("auto", "cuda:1")) == (dtype, why)
    assert (resolve.resolve_dtype("float32", "cuda"), resolve.dtype_reason("float32", "cuda")) == (torch.float32, "set by --dtype")
    if not native:
        with pytest.raises(ConfigError, match=r"^kv_cache_dtype bfloat16 takes a float32 or bfloat16 model, not float16 "
                                              r"\(dtype auto chose float16: this GPU has no native bf16\)$"):
            resolve.resolve_kv_cache_dtype(KVCacheDType.BFLOAT16, dtype)


def test_chunked_prefill_and_tiny_cache_give_the_same_tokens(tiny_loaded, hf_tiny):
    expected = [o.outputs.token_ids for o in run(engine(tiny_loaded), PROMPTS)]
    chunked = run(engine(tiny_loaded, budget=7), PROMPTS)
    assert [o.outputs.token_ids for o in chunked] == expected
    # 40 blocks of 4 tokens cannot hold all five requests at once: some are preempted and recomputed.
    small = engine(tiny_loaded, num_blocks=40)
    outs = run(small, PROMPTS)
    assert [o.outputs.token_ids for o in outs] == expected
    assert small.kv.num_free_blocks == 40
    small.kv.pool.check_integrity()


def test_prompt_logprobs_match_hf_logits(tiny_loaded, hf_tiny):
    core = engine(tiny_loaded, budget=5)  # chunked: logprobs span chunk boundaries
    ids = core.tokenizer.encode("Logits, please.")
    [out] = run(core, [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    with torch.no_grad():
        ref = torch.log_softmax(hf_tiny(torch.tensor([ids])).logits[0].float(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    ours = torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
    theirs = torch.tensor([ref[i - 1, ids[i]].item() for i in range(1, len(ids))])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # Each prompt token's rank as vLLM counts it (the tokens at least as likely, itself included): within
    # what HF's logits allow at that 1e-4 (the random model's logits tie closely), ...
    for i in range(1, len(ids)):
        above, tied = ((ref[i - 1] > theirs[i - 1] + 1e-4).sum().item(), (ref[i - 1] >= theirs[i - 1] - 1e-4).sum().item())
        assert above + 1 <= out.prompt_ranks[i] <= tied, (i, above, tied, out.prompt_ranks[i])
    # ... and exact against the engine's own top 20: where the token is among them, the count of those at
    # least as likely; elsewhere over 20.
    [top] = run(core, [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20))
    for i in range(1, len(ids)):
        entries, actual = top.prompt_logprobs[i], top.prompt_logprobs[i][ids[i]]
        if len(entries) == 20:  # the actual token was one of the top 20 (else it is a 21st entry)
            assert top.prompt_ranks[i] == sum(lp >= actual for lp in entries.values())
        else:
            assert top.prompt_ranks[i] > 20
    assert top.prompt_ranks[0] is None and top.prompt_ranks[1:] == out.prompt_ranks[1:]
    assert top.prompt_ranks[1:] != [1] * (len(ids) - 1)  # not every prompt token is the model's likeliest


def test_prefix_cache_hits_and_same_output(tiny_loaded):
    core = engine(tiny_loaded)
    prefix = list(range(40, 60))  # 20 tokens = 5 full blocks
    [first] = run(core, [prefix + [1, 2, 3]])
    [second] = run(core, [prefix + [7, 8]])
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20
    [fresh] = run(engine(tiny_loaded, caching=False), [prefix + [7, 8]])
    assert second.outputs.token_ids == fresh.outputs.token_ids
    assert core.reset_prefix_cache() is True
    [third] = run(core, [prefix + [7, 8]])
    assert third.num_cached_tokens == 0


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(tiny_loaded):
    core = engine(tiny_loaded)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a, b = run(core, ["sample me", "sample me"], seeded)
    assert a.outputs.token_ids == b.outputs.token_ids
    other = run(core, ["sample me"], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True))[0]
    assert other.outputs.token_ids != a.outputs.token_ids
    top1 = run(core, ["sample me"], SamplingParams(max_tokens=12, temperature=0.8, top_k=1, ignore_eos=True))[0]
    greedy = run(core, ["sample me"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert top1.outputs.token_ids == greedy.outputs.token_ids


def test_stop_strings_stop_ids_min_tokens_and_logprobs(tiny_loaded):
    core = engine(tiny_loaded)
    [base] = run(core, ["Hello, world"])
    tokens, text = base.outputs.token_ids, base.outputs.text
    stop_id = tokens[3]
    [by_id] = run(core, ["Hello, world"], SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[stop_id]))
    first = tokens.index(stop_id)
    assert by_id.outputs.token_ids == tokens[: first + 1]
    assert (by_id.outputs.finish_reason, by_id.outputs.stop_reason) == (FinishReason.STOP, stop_id)
    stop_str = text[5:7]
    [by_str] = run(core, ["Hello, world"], SamplingParams(max_tokens=16, temperature=0, stop=[stop_str]))
    assert by_str.outputs.text == text[: text.index(stop_str)]
    assert (by_str.outputs.finish_reason, by_str.outputs.stop_reason) == (FinishReason.STOP, stop_str)
    [with_lp] = run(core, ["Hello, world"], SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    assert [len(d) for d in with_lp.outputs.logprobs] == [3, 3, 3, 3]  # greedy token is in the top 3
    assert all(max(d, key=d.get) == t for d, t in zip(with_lp.outputs.logprobs, with_lp.outputs.token_ids))


def test_eos_and_min_tokens(tiny_loaded):
    core = engine(tiny_loaded)
    eos = core.eos_token_ids[0]
    forced = SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[], min_tokens=6)
    [out] = run(core, ["x"], forced)
    assert len(out.outputs.token_ids) == 6 and eos not in out.outputs.token_ids
    assert out.outputs.finish_reason is FinishReason.LENGTH


def test_the_eos_that_ends_a_request_is_not_text_even_when_special_tokens_are_kept(tiny_loaded):
    core = engine(tiny_loaded)
    eos = core.eos_token_ids[0]
    kept = SamplingParams(max_tokens=6, temperature=0, skip_special_tokens=False, logit_bias={eos: 100.0}, min_tokens=2)
    [out] = run(core, ["x"], kept)
    assert (len(out.outputs.token_ids), out.outputs.token_ids[-1], out.outputs.finish_reason) == (3, eos, FinishReason.STOP)
    before = core.tokenizer.decode(out.outputs.token_ids[:2], skip_special_tokens=False)
    assert out.outputs.text == before  # the EOS that ends it adds no text, as in vLLM
    [ignored] = run(core, ["x"], SamplingParams(max_tokens=2, temperature=0, skip_special_tokens=False,
                                                 logit_bias={eos: 100.0}, ignore_eos=True))
    assert ignored.outputs.text == core.tokenizer.decode([eos, eos], skip_special_tokens=False)  # not an end: text


@pytest.mark.parametrize(
    "prompt, params, message, param",
    [
        ([], GREEDY, "the prompt is empty: it must contain at least one token", "prompt"),
        ([1, 5000], GREEDY, "token id 5000 is out of vocabulary (vocab_size=320)", "prompt"),
        ([-1], GREEDY, "token id -1 is out of vocabulary (vocab_size=320)", "prompt"),
        ([1] * 512, GREEDY, "the prompt has 512 tokens; the context length is 512, so a prompt may have at most 511 tokens", "prompt"),
    ],
)
def test_bad_prompts_raise_typed_errors(tiny_loaded, prompt, params, message, param):
    core = engine(tiny_loaded, max_seqs=2)
    with pytest.raises(InvalidRequest) as err:
        core.add_request("r", prompt, params)
    assert (str(err.value), err.value.param) == (message, param)
    assert not core.has_unfinished()


def test_bad_sampling_params_raise_typed_errors():
    with pytest.raises(InvalidRequest, match=r"^max_tokens must be at least 0, got -1$"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(InvalidRequest, match=r"^top_p must be in \(0, 1\], got 0.0$"):
        SamplingParams(top_p=0.0)


def test_prompt_larger_than_the_whole_cache_is_rejected(tiny_loaded):
    core = engine(tiny_loaded, num_blocks=4)
    with pytest.raises(InvalidRequest, match=r"^the prompt needs 5 KV blocks; the cache holds 4$"):
        core.add_request("r", list(range(1, 18)), GREEDY)


def test_abort_frees_every_block(tiny_loaded):
    core = engine(tiny_loaded, num_blocks=64)
    core.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    core.add_request("b", list(range(1, 10)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    core.step()
    core.step()
    assert core.kv.num_free_blocks < 64
    assert core.abort("a") and core.abort("b")
    outs = core.step()
    assert {(o.request_id, o.outputs.finish_reason) for o in outs} == {("a", FinishReason.ABORT), ("b", FinishReason.ABORT)}
    assert core.kv.num_free_blocks == 64
    assert core.abort("a") is False


def test_sleep_and_wake_up(tiny_loaded):
    core = engine(tiny_loaded)
    [before] = run(core, ["sleepy"])
    core.sleep(1)
    assert core.is_sleeping() and core.runner.kv_cache is None
    with pytest.raises(EngineSleeping, match="^the engine is sleeping; call wake_up\\(\\) first$"):
        core.add_request("r", [1, 2], GREEDY)
    core.wake_up()
    assert [o.outputs.token_ids for o in run(core, ["sleepy"])] == [before.outputs.token_ids]


def test_llm_offline_api(tiny_loaded):
    llm = LLM(model="tiny", dtype="float32", num_blocks=128, block_size=4)
    outs = llm.generate(["Hello, world", [5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [len(o.outputs.token_ids) for o in outs] == [5, 5]
    assert outs[0].outputs.text == llm.tokenizer.decode(outs[0].outputs.token_ids)
    with pytest.raises(TypeError, match="unknown engine option 'block_sise'"):
        LLM(model="tiny", block_sise=4)


def test_sleep_level_2_drops_weights_and_wake_up_reloads_them(tiny_loaded):
    core = EngineCore(EngineConfig(model=ModelConfig(model="tiny", dtype="float32"),
                                   cache=CacheConfig(block_size=4, num_blocks=64)))
    [before] = run(core, ["deep sleep"])
    core.sleep(2)
    assert core.runner.model is None and core.runner.kv_cache is None and core.loaded is None
    core.wake_up()
    assert not core.is_sleeping()
    assert [o.outputs.token_ids for o in run(core, ["deep sleep"])] == [before.outputs.token_ids]


def test_csrc_prefill_attention_gives_the_torch_paths_tokens_across_chunks_and_cached_prefixes(tiny_loaded):
    """A tiny model with 64-wide heads (3 query heads per KV head) takes csrc's paged_prefill_attention:
    prompts prefilled in chunks of 7 tokens (start_pos > 0 in every later chunk) give the pure-torch
    engine's (SDPA) tokens and prompt logprobs, and a prompt that starts from 5 cached blocks its tokens
    (prompt logprobs turn the prefix cache off, so that run asks for none)."""
    model = _wide_heads(tiny_loaded)
    ours, torch_ops = engine(model, budget=7), engine(model, kernels="torch", caching=False)
    assert (ours.runner.model._csrc_prefill, torch_ops.runner.model._csrc_prefill) == (True, False)
    scored = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    for ids in (list(range(100, 137)), list(range(40, 60)) + [1, 2, 3]):
        [out], [ref] = run(ours, [ids], scored), run(torch_ops, [ids], scored)
        assert out.outputs.token_ids == ref.outputs.token_ids
        got = torch.tensor([out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
        want = torch.tensor([ref.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    prefix = list(range(40, 60))  # 20 tokens = 5 full blocks of 4
    run(ours, [prefix + [1, 2, 3]])
    [hit] = run(ours, [prefix + [7, 8]])
    assert hit.num_cached_tokens == 20
    assert hit.outputs.token_ids == run(torch_ops, [prefix + [7, 8]])[0].outputs.token_ids


def test_the_forward_runs_in_inference_mode_and_writes_the_cache_in_place(tiny_loaded):
    """No autograd bookkeeping on the hot path; the per-layer cache views are views of the one cache."""
    core = engine(tiny_loaded)
    runner = core.runner
    outputs = []
    forward = runner.model.forward
    runner.model.forward = lambda *args: outputs.append(forward(*args)) or outputs[-1]
    run(core, [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(outputs) == 2 and all(torch.is_inference(o) for o in outputs)
    k_cache, v_cache = runner.layer_caches[1]
    assert (k_cache.data_ptr(), v_cache.data_ptr()) == (runner.kv_cache[:, 1, 0].data_ptr(), runner.kv_cache[:, 1, 1].data_ptr())
    assert k_cache.abs().sum().item() > 0  # layer 1's keys of the 6 positions were written through the views
    core.sleep(1)
    assert (runner.kv_cache, runner.layer_caches) == (None, [])


def test_a_resumed_request_goes_on_as_if_never_interrupted(tiny_loaded):
    """Migration: the tokens another engine produced are computed with the prompt, never emitted
    again, and count toward max_tokens and the stop rules; what follows equals the undisturbed run."""
    core = engine(tiny_loaded)
    prompt = core.tokenizer.encode(PROMPTS[1])
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    [whole] = run(core, [prompt], params)
    done = whole.outputs.token_ids[:7]
    core.add_request("resumed", prompt, params, resume_token_ids=done)
    emitted, text, final = [], "", None
    while core.has_unfinished():
        for out in core.step():
            emitted += out.new_token_ids
            text += out.new_text
            final = out
    assert emitted == whole.outputs.token_ids[7:]
    assert (final.outputs.token_ids, final.outputs.finish_reason) == (whole.outputs.token_ids, FinishReason.LENGTH)
    assert text == whole.outputs.text[len(core.tokenizer.decode(done)):]
    assert [len(top) > 0 for top in final.outputs.logprobs] == [False] * 7 + [True] * 9
