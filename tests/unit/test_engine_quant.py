"""The engine on quantized weights: quantize-on-load (tiny model) and a GGUF's own blocks (SmolLM2).

Each test runs both routes a CPU may take (the `route` fixture): csrc's quant_matmul (int8
activations in blocks of 32; chosen with the avx512 and avx2 builds, forced here on any build, where
it computes the same bits) and torch's packed kernels (bfloat16 activations).
"""

import dataclasses

import pytest
import torch

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
from disagg.engine.core import EngineCore
from disagg.engine.loader import load_model
from disagg.ops import loader, quant
from disagg.types import SamplingParams
from engine_runs import run_requests
from kernel_summary import auto_kernels, cpu_summary, dense_kernel, huge_pages

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0)
QUANTIZE = {"int8": quant.quantize_int8, "int4": quant.quantize_int4}


@pytest.fixture(params=["quant_matmul", "torch"])
def route(request, monkeypatch):
    monkeypatch.setattr(loader, "QUANT_MATMUL_ISAS", ("base", "avx2", "avx512") if request.param == "quant_matmul" else ())
    return request.param


def engine(loaded, quantization="none", dtype="float32", model="tiny", kernels="auto"):
    config = EngineConfig(model=ModelConfig(model=model, dtype=dtype, quantization=quantization, kernels=kernels),
                          cache=CacheConfig(num_blocks=128, block_size=4))
    return EngineCore(config, loaded)


def run_all(core, prompts, params=PARAMS):
    return run_requests(core, [(ids, params) for ids in prompts])


def prompt_logprob_errors(outs, refs, prompts) -> torch.Tensor:
    """|logprob of each prompt token (from the second) under `outs` - under `refs`|, all prompts."""
    return torch.tensor([abs(out.prompt_logprobs[i][ids[i]] - ref.prompt_logprobs[i][ids[i]])
                         for out, ref, ids in zip(outs, refs, prompts) for i in range(1, len(ids))])


def tiny_prompts(tokenizer):
    return [tokenizer.encode(t) for t in ("hello world, this is a test", "The quick brown fox", "1 2 3 4 5 6")]


def dequantized_copy(loaded, quantization):
    """`loaded` with every matmul weight replaced by its quantize-then-dequantize (the embedding kept)."""
    weights = {name: quant.dequantize(QUANTIZE[quantization](w)) if w.dim() == 2 and "embed" not in name else w
               for name, w in loaded.weights.items()}
    return dataclasses.replace(loaded, weights=weights)


# The largest prompt-logprob error against the dense float32 engine on the quantize-then-dequantize
# weights: the activations' rounding is all that differs, to int8 blocks or to bfloat16. Measured on
# the short prompts / the long one: quant_matmul int8 0.176 / 0.160, int4 0.078 / 0.125; torch int8
# 0.048 / 0.072, int4 0.063 / 0.084.
DEQUANTIZED_BOUND = {("quant_matmul", "int8"): 0.25, ("quant_matmul", "int4"): 0.2, ("torch", "int8"): 0.1,
                     ("torch", "int4"): 0.1}


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_engine_computes_with_the_dequantized_weights(tiny_loaded, quantization, route):
    prompts = tiny_prompts(tiny_loaded.tokenizer)
    outs = run_all(engine(tiny_loaded, quantization), prompts)
    refs = run_all(engine(dequantized_copy(tiny_loaded, quantization)), prompts)
    assert prompt_logprob_errors(outs, refs, prompts).max() <= DEQUANTIZED_BOUND[route, quantization]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_long_prompt_computes_with_the_dequantized_weights(tiny_loaded, quantization, route):
    """A prompt of 192 tokens: a prefill of many rows through either route's kernels."""
    core = engine(tiny_loaded, quantization)
    qkv = core.runner.model.layers[0]["qkv"]
    assert (qkv.quant_matmul is not None) == (route == "quant_matmul")
    text = " ".join(str(i) for i in range(96))
    prompts = [tiny_loaded.tokenizer.encode(text)[:192]]
    assert len(prompts[0]) == 192
    outs = run_all(core, prompts)
    refs = run_all(engine(dequantized_copy(tiny_loaded, quantization)), prompts)
    assert prompt_logprob_errors(outs, refs, prompts).max() <= DEQUANTIZED_BOUND[route, quantization]


@pytest.mark.parametrize("quantization, mean_error", [("int8", 0.1), ("int4", 0.75)])
def test_quantized_engine_stays_near_the_dense_one(tiny_loaded, quantization, mean_error, route):
    """The tiny model's wide random weights are the worst case for 4 bits: against the dense engine the mean
    prompt-logprob error measured 0.028-0.060 (int8) and 0.28-0.53 (int4) per prompt on torch's route,
    0.035-0.078 (int8) and 0.27-0.53 (int4) on quant_matmul."""
    prompts = tiny_prompts(tiny_loaded.tokenizer)
    for dtype in ("float32", "bfloat16"):
        outs = run_all(engine(tiny_loaded, quantization, dtype), prompts)
        refs = run_all(engine(tiny_loaded, "none", dtype), prompts)
        assert prompt_logprob_errors(outs, refs, prompts).mean() <= mean_error


def test_engine_summary_says_dtype_and_kernels(tiny_loaded, route):
    dense = engine(tiny_loaded)
    assert dense.engine_summary == (
        f"{cpu_summary()}, "
        f"dtype float32 (set by --dtype), {auto_kernels()}, quantization none: 9 float32 dense ({dense_kernel()}), "
        "kv cache float32 (auto: the model's dtype)" + huge_pages(dense))
    reference = engine(tiny_loaded, kernels="torch")
    assert reference.engine_summary == (
        f"{cpu_summary()}, "
        "dtype float32 (set by --dtype), kernels torch (set by --kernels), quantization none: 9 float32 dense (F.linear), "
        "kv cache float32 (auto: the model's dtype)" + huge_pages(reference))
    assert reference.runner.model.huge_page_bytes == 0  # F.linear's weights are the loader's own: never copied
    expected = "9 quantized on load as int4 g32 (torch int4pack, bfloat16 activations)"
    if route == "quant_matmul":
        expected = "9 quantized on load as int4 g32 (csrc quant_matmul, int8 activations in blocks of 32)"
    int4 = engine(tiny_loaded, "int4", "bfloat16")
    assert int4.engine_summary == (
        f"{cpu_summary()}, dtype bfloat16 (set by --dtype), {auto_kernels()}, quantization int4: {expected}, "
        "kv cache bfloat16 (auto: the model's dtype)" + huge_pages(int4))
    assert (int4.runner.model.huge_page_bytes > 0) == (route == "quant_matmul")  # csrc's blocks are placed
    int4_torch = engine(tiny_loaded, "int4", "bfloat16", kernels="torch")
    assert int4_torch.engine_summary == (
        f"{cpu_summary()}, dtype bfloat16 (set by --dtype), kernels torch (set by --kernels), quantization int4: "
        "9 quantized on load as int4 g32 (torch int4pack, bfloat16 activations), kv cache bfloat16 (auto: the model's dtype)"
        + huge_pages(int4_torch))


def test_quantization_auto_takes_a_gguf_files_own_blocks_on_cpu_only(tiny_loaded):
    from disagg.engine.resolve import resolve_quantization

    gguf, why = resolve_quantization(ModelConfig(quantization="auto"))  # the default model: a .gguf file
    assert (gguf.quantization, why) == ("gguf_float", "auto: a .gguf file, its own blocks on CPU, float32 activations")
    cuda, why = resolve_quantization(ModelConfig(quantization="auto", device="cuda"))
    assert (cuda.quantization, why) == ("none", "auto: the GGUF's blocks run on CPU only")
    split, why = resolve_quantization(ModelConfig(quantization="auto"), tp_size=3)
    assert (split.quantization, why) == ("none", "auto: tensor parallelism splits dense weights")
    assert resolve_quantization(ModelConfig(quantization="int8")) == (ModelConfig(quantization="int8"), None)
    reference = engine(tiny_loaded, "auto", kernels="torch")
    assert reference.engine_summary == (
        f"{cpu_summary()}, "
        "dtype float32 (set by --dtype), kernels torch (set by --kernels), quantization none (auto: not a .gguf file): "
        "9 float32 dense (F.linear), kv cache float32 (auto: the model's dtype)" + huge_pages(reference))


@pytest.fixture(scope="module")
def smollm2_gguf():
    return load_model(ModelConfig(quantization="gguf"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gguf_blocks_are_the_dense_loaders_weights_bit_for_bit(smollm2_loaded, smollm2_gguf):
    """Every Q4_1 weight (Q/K rows un-permuted) and the Q8_0 tied head dequantize to exactly what the
    dense loader produced; the embedding lookup stays dense."""
    assert len(smollm2_gguf.quantized) == 211
    assert {w.source for w in smollm2_gguf.quantized.values()} == {"Q4_1", "Q8_0"}
    for name, w in smollm2_gguf.quantized.items():
        dense = smollm2_loaded.weights["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert torch.equal(quant.dequantize(w), dense), name
    assert smollm2_gguf.weights.keys() == {n for n in smollm2_loaded.weights if "norm" in n or "embed" in n}


# Greedy tokens identical to the dense engine's before the first difference, per prompt: measured
# 5, 13, 16 on quant_matmul (the first prompt parts after " Paris.\n\n", where the dense engine's two
# best tokens are close) and 16, 16, 16 on torch's route. quant_matmul gives the same bits on every
# instruction set, attention and the norms do not: one token of margin where it diverged here.
SAME_TOKENS = {"quant_matmul": [4, 12, 16], "torch": [16, 16, 16]}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gguf_engine_stays_near_the_dense_engine_on_the_same_file(smollm2_loaded, smollm2_gguf, route):
    """Prompt logprobs against the dense engine on the same GGUF, measured: quant_matmul (int8
    activations, as llama.cpp rounds them) max 0.703, mean 0.097, the largest at tokens the model
    gives logprobs below -10; torch's route (bfloat16 activations, its Q8_0 head requantized per
    channel) max 0.169, mean 0.059. Dense bfloat16's own error against float32 is mean 0.079
    (test_engine_smollm2)."""
    tokenizer = smollm2_loaded.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):", chat)]
    gguf = engine(smollm2_gguf, "gguf", model="smollm2-135m")
    if route == "quant_matmul":
        kernel = "csrc quant_matmul, int8 activations in blocks of 32"
        weights = f"120 Q4_1 as int4 g32 ({kernel}), 1 Q8_0 as int8 g32 ({kernel})"
    else:
        weights = ("120 Q4_1 as int4 g32 (torch int4pack, bfloat16 activations), "
                   "1 Q8_0 requantized as int8 per channel (torch int8pack, bfloat16 activations)")
    assert gguf.engine_summary == (f"{cpu_summary()}, dtype float32 (set by --dtype), {auto_kernels()}, quantization gguf: {weights}, "
                                   "kv cache float32 (auto: the model's dtype)" + huge_pages(gguf))
    outs = run_all(gguf, prompts)
    refs = run_all(engine(smollm2_loaded, model="smollm2-135m"), prompts)
    errors = prompt_logprob_errors(outs, refs, prompts)
    assert errors.max() <= 0.9 and errors.mean() <= 0.12
    for out, ref, same in zip(outs, refs, SAME_TOKENS[route]):
        assert out.outputs.token_ids[:same] == ref.outputs.token_ids[:same]
    assert outs[0].outputs.text.startswith(" Paris.")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gguf_float_runs_the_blocks_with_the_dense_engines_numbers(smollm2_loaded, smollm2_gguf, monkeypatch):
    """gguf_float keeps the file's Q4_1 and Q8_0 blocks and multiplies them dequantized in registers
    by float32 activations: the dense float32 engine's numbers, summed in another order. Measured on
    these prompts (106 positions) with the avx512 build: prompt logprobs equal to the dense engine's
    to the last bit (the bound leaves room for another order elsewhere); the same 16 greedy tokens; the
    README's question answered as the dense weights answer it (gguf's int8 activations do not).
    dequant_matmul is forced on any build (the base build's goes dense otherwise), as `route` forces
    quant_matmul."""
    monkeypatch.setattr(loader, "QUANT_MATMUL_ISAS", ("base", "avx2", "avx512"))
    tokenizer = smollm2_loaded.tokenizer
    question = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ("The capital of France is", question)]
    prompts.append(tokenizer.encode("The printing press changed how books were made across Europe. " * 6))
    fast = engine(smollm2_gguf, "gguf_float", model="smollm2-135m")
    kernel = "csrc dequant_matmul, float32 activations"
    assert fast.engine_summary == (
        f"{cpu_summary()}, "
        f"dtype float32 (set by --dtype), {auto_kernels()}, quantization gguf_float: 120 Q4_1 as int4 g32 ({kernel}), "
        f"1 Q8_0 as int8 g32 ({kernel}), kv cache float32 (auto: the model's dtype)" + huge_pages(fast))
    outs = run_all(fast, prompts)
    refs = run_all(engine(smollm2_loaded, model="smollm2-135m"), prompts)
    assert prompt_logprob_errors(outs, refs, prompts).max() <= 1e-4
    assert [o.outputs.token_ids for o in outs] == [r.outputs.token_ids for r in refs]
    answer = run_all(fast, prompts[1:2], SamplingParams(max_tokens=16, temperature=0))[0].outputs
    assert (answer.text, answer.token_ids) == ("The capital of France is Paris.", [504, 3575, 282, 4649, 314, 7042, 30, 2])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gguf_engine_on_a_long_prompt_stays_near_the_dense_engine(smollm2_loaded, smollm2_gguf, route):
    """A 131-token prompt, measured against dense float32: quant_matmul max 0.237, mean 0.043 (16 of 16
    greedy tokens equal); torch's route max 0.254, mean 0.029 (16 of 16)."""
    text = ("The history of the printing press begins in the fifteenth century, when movable type changed how books "
            "were made across Europe. Before it, scribes copied every page by hand, and a single book could take "
            "months. Printers in many cities soon set up shops, and the price of books fell quickly as more of them "
            "were made. ") * 2
    prompts = [smollm2_loaded.tokenizer.encode(text)]
    assert len(prompts[0]) == 131
    [out] = run_all(engine(smollm2_gguf, "gguf", model="smollm2-135m"), prompts)
    [ref] = run_all(engine(smollm2_loaded, model="smollm2-135m"), prompts)
    errors = prompt_logprob_errors([out], [ref], prompts)
    assert errors.max() <= 0.35 and errors.mean() <= 0.05
    assert out.outputs.token_ids[:4] == ref.outputs.token_ids[:4]
