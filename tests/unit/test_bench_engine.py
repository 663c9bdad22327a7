"""`disagg bench engine`'s arithmetic: the weight bytes a decode step streams and the bound lines."""

from __future__ import annotations

import argparse

import pytest
import torch

from disagg.bench.engine import (Result, best_in_rounds, bound_lines, compute_bound_lines, engine_forms, instruction_set,
                                 isas_for, machine_line, measure_matmul_gflops, run_with_isa, table)
from disagg.engine.models.llama import LlamaModel
from disagg.ops import load_ops
from disagg.ops.cpu import cpu_features


@pytest.mark.slow
def test_weight_bytes_count_every_matrix_and_the_head_once(smollm2_loaded):
    model = LlamaModel(smollm2_loaded.arch, smollm2_loaded.weights, torch.float32, "cpu")
    # Per layer: q,k,v (576 x 960) + o (576 x 576) + gate, up, down (3 x 576 x 1536); then the 49152 x 576 head.
    assert model.weight_bytes() == (30 * 3_538_944 + 28_311_552) * 4 == 537_919_488
    assert LlamaModel(smollm2_loaded.arch, smollm2_loaded.weights, torch.bfloat16, "cpu").weight_bytes() == 268_959_744


def test_bound_lines_state_the_fraction_of_both_bounds():
    results = [Result("float32", "csrc-avx2", "none", 1, 300.0, 30.0, 250.0, 20.0),
               Result("float32", "csrc-avx2", "none", 1, 300.0, 31.0, 250.0, 20.0, kv_cache_dtype="bfloat16"),
               Result("float32", "torch", "none", 16, 1, 1, 1, 1)]
    text = bound_lines(results, {("float32", "csrc-avx2", "none"): 537_919_488}, memcpy_gbps=16.0, read_gbps=32.0)
    assert text.splitlines() == [
        "memory in this run: memcpy 16.0 GB/s, read 32.0 GB/s; batch-1 decode bound = GB/s / weight bytes per step",
        "- float32, csrc-avx2, none (513 MiB of weights): 30.0 tok/s = 101% of the memcpy bound (29.7 tok/s), "
        "50% of the read bound (59.5 tok/s)",
        "- float32, csrc-avx2, none, kv cache bfloat16 (513 MiB of weights): 31.0 tok/s = 104% of the memcpy bound "
        "(29.7 tok/s), 52% of the read bound (59.5 tok/s)",
    ]


def test_compute_bound_lines_state_float32_batch_rows_against_the_matmul_rate():
    sizes = {("float32", "csrc-avx512", "none"): 537_919_488, ("float32", "csrc-avx512", "gguf"): 80_000_000}
    results = [Result("float32", "csrc-avx512", "none", 1, 800.0, 50.0, 700.0, 40.0),
               Result("float32", "csrc-avx512", "none", 16, 750.0, 380.0, 580.0, 150.0),
               Result("float32", "csrc-avx512", "none", 16, 750.0, 410.0, 580.0, 150.0, kv_cache_dtype="bfloat16"),
               Result("float32", "csrc-avx512", "gguf", 16, 1700.0, 800.0, 580.0, 150.0)]
    text = compute_bound_lines(results, sizes, matmul_gflops=150.0)
    # 134,479,872 weights, two FLOPs each per row: 150e9 / 268,959,744 = 557.7 tok/s.
    assert text.splitlines() == [
        "float32 matmul in this run: 150 GFLOP/s; batch decode bound = GFLOP/s / (2 x weights per row)",
        "- float32, csrc-avx512, batch 16 (134.5M weights): 380.0 tok/s = 68% of the compute bound (557.7 tok/s)",
        "- float32, csrc-avx512, kv cache bfloat16, batch 16 (134.5M weights): 410.0 tok/s = 74% of the compute bound "
        "(557.7 tok/s)",
    ]


def test_the_matmul_rate_is_the_best_of_the_timed_products():
    ticks = iter([0.0, 0.004, 1.0, 1.002, 2.0, 2.008])  # three products: 4, 2 and 8 ms
    gflops = measure_matmul_gflops(size=100, repeat=3, clock=lambda: next(ticks))
    assert gflops == pytest.approx(2 * 100**3 / 0.002 / 1e9) == pytest.approx(1.0)


def test_every_run_takes_its_turn_each_round_and_keeps_its_best_rates():
    calls = []
    ours = iter([(700.0, 300.0), (650.0, 340.0)])
    bf16_cache = iter([(690.0, 360.0), (720.0, 350.0)])
    theirs = iter([(500.0, 120.0), (560.0, 110.0)])
    best = best_in_rounds([lambda: calls.append("ours") or next(ours),
                           lambda: calls.append("bf16 cache") or next(bf16_cache),
                           lambda: calls.append("hf") or next(theirs)], repeat=2)
    assert calls == ["ours", "bf16 cache", "hf", "ours", "bf16 cache", "hf"]
    assert best == [(700.0, 340.0), (720.0, 360.0), (560.0, 120.0)]
    assert best_in_rounds([lambda: (1.0, 2.0)], repeat=0) == [(1.0, 2.0)]  # one round at least


def test_the_machine_line_names_the_flags_and_threads():
    line = machine_line()
    assert line.startswith("CPU: ") and f"{torch.get_num_threads()} torch threads" in line
    assert "flags: " in line and f"; runs as {cpu_features().describe()}; " in line


def test_the_machine_line_names_the_levels_torchs_libraries_are_held_to(monkeypatch):
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert machine_line().endswith(f"torch {torch.__version__} (its libraries held: MKL_ENABLE_INSTRUCTIONS=AVX2)")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    assert machine_line().endswith(f"torch {torch.__version__}")


def test_the_table_gives_ratios_and_dashes_where_hf_did_not_run():
    nan = float("nan")
    results = [Result("float32", "csrc-avx512", "gguf", 16, 1744.0, 509.3, 872.0, 166.0, kv_cache_dtype="bfloat16"),
               Result("bfloat16", "csrc-avx512", "gguf", 1, 1564.0, 144.1, nan, nan)]
    rows = table(results, argparse.Namespace(input_len=256, output_len=32)).splitlines()[-2:]
    assert rows == ["| float32 | csrc-avx512 | gguf | bfloat16 | 16 | 1744 | 872 | 2.00x | 509.3 | 166.0 | 3.07x |",
                    "| bfloat16 | csrc-avx512 | gguf | auto | 1 | 1564 | - | - | 144.1 | - | - |"]


class _TickingTime:
    """The module `time` as bench_hf sees it: perf_counter() returns 0, 1, 2, ... one per call."""

    def __init__(self) -> None:
        self.now = -1.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_hf_is_timed_per_step_inside_one_generate(tiny_loaded, monkeypatch):
    """One generate() of output_len + 1 tokens: the clock reads once before it and once per step, so
    prefill is 1 tick and the 3 decode steps are 3 ticks (a second generate() would read it more)."""
    from disagg.bench import engine as bench_engine
    from disagg.bench.hf_baseline import hf_model_from_loaded

    clock = _TickingTime()
    monkeypatch.setattr(bench_engine, "time", clock)
    batch = [[5, 6, 7, 8], [9, 10, 11, 12]]
    prefill_tps, decode_tps = bench_engine.bench_hf(hf_model_from_loaded(tiny_loaded), batch, output_len=3)
    assert clock.now == 4.0  # start, then steps 1 (the first token) .. 4
    assert (prefill_tps, decode_tps) == (8.0, 2.0)  # 8 prompt tokens in 1 tick; 2 x 3 tokens in 3 ticks


def test_isas_make_one_csrc_form_each_and_leave_torch_and_the_default_alone():
    assert isas_for("auto", "avx512,avx2") == ["avx512", "avx2"]
    assert isas_for("csrc", "base") == ["base"]
    assert isas_for("torch", "avx512,avx2") == [None]
    assert isas_for("auto", None) == [None]


def test_an_instruction_set_is_switched_for_the_run_and_switched_back():
    best = torch.ops.disagg.isa()
    seen = []
    with instruction_set("base"):
        seen.append(torch.ops.disagg.isa())
        seen.append(load_ops("csrc").name)
    assert seen == ["base", "csrc-base"]
    assert torch.ops.disagg.isa() == best
    with pytest.raises(ValueError, match="raised inside"):
        run_with_isa("base", _raise)
    assert torch.ops.disagg.isa() == best
    with instruction_set(None):
        assert torch.ops.disagg.isa() == best


def test_huge_pages_on_and_off_make_two_forms_the_second_named_for_its_pages(tiny_loaded):
    args = argparse.Namespace(model="tiny", kernels="auto", quantization="none", kv_cache_dtypes="auto",
                              huge_pages="on,off", isas=None)
    sizes = {}
    forms = engine_forms(args, "float32", {"none": tiny_loaded}, sizes)
    name = load_ops("auto").name
    assert [(f[1], f[0].config.model.huge_pages) for f in forms] == [(name, True), (f"{name} 4K pages", False)]
    assert sizes[("float32", name, "none")] == sizes[("float32", f"{name} 4K pages", "none")]
    with pytest.raises(ValueError, match="--huge-pages takes on and off, got 'yes'"):
        engine_forms(argparse.Namespace(**{**vars(args), "huge_pages": "yes"}), "float32", {"none": tiny_loaded}, {})


def _raise():
    assert torch.ops.disagg.isa() == "base"
    raise ValueError("raised inside")
