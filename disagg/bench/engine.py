"""`disagg bench engine`: prefill and decode tok/s of our engine beside HF transformers `generate()`.

Both run in the same process on the same weights and threads, one after the other, so the ratios
hold even on a noisy shared machine. HF transformers is a dev dependency: `pip install transformers`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from disagg.cli_args import comma_list
from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.core import EngineCore
from disagg.bench.hf_baseline import hf_model_from_loaded
from disagg.engine.loader import load_model
from disagg.types import SamplingParams


@dataclass
class Result:
    dtype: str
    quantization: str
    batch: int
    ours_prefill_tps: float
    ours_decode_tps: float
    hf_prefill_tps: float
    hf_decode_tps: float


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(100, vocab, (batch, length), generator=gen).tolist()


def bench_ours(engine: EngineCore, batch: list[list[int]], output_len: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s): time to first token of the whole batch, then the rest."""
    assert engine.reset_prefix_cache(), "bench needs an idle engine"  # no prefix hits between runs
    params = SamplingParams(max_tokens=output_len + 1, temperature=0, ignore_eos=True)
    for prompt in batch:
        engine.add_request(engine.new_request_id(), prompt, params)
    start = time.perf_counter()
    num_sampled = 0
    while num_sampled < len(batch):
        num_sampled += sum(1 for out in engine.step() if len(out.outputs.token_ids) == 1)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    decode_s = time.perf_counter() - start
    return sum(map(len, batch)) / prefill_s, len(batch) * output_len / decode_s


@torch.inference_mode()
def bench_hf(model, batch: list[list[int]], output_len: int) -> tuple[float, float]:
    ids = torch.tensor(batch)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=output_len + 1, min_new_tokens=output_len + 1, **kwargs)
    decode_s = max(time.perf_counter() - start - prefill_s, 1e-9)
    return ids.numel() / prefill_s, len(batch) * output_len / decode_s


def profile_decode(engine: EngineCore, batch: list[list[int]], num_steps: int = 8) -> str:
    """Top ops by self CPU time over `num_steps` decode steps of `batch` (where the time goes)."""
    from torch.profiler import profile

    assert engine.reset_prefix_cache(), "profile needs an idle engine"
    params = SamplingParams(max_tokens=num_steps + 2, temperature=0, ignore_eos=True)
    for prompt in batch:
        engine.add_request(engine.new_request_id(), prompt, params)
    engine.step()  # the prefill
    with profile() as prof:
        for _ in range(num_steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)


def run(args: argparse.Namespace) -> int:
    quantizations = comma_list(args.quantization)
    dense = load_model(ModelConfig(model=args.model))
    loads = {q: load_model(ModelConfig(model=args.model, quantization=q)) if q == "gguf" else dense for q in quantizations}
    results = []
    for dtype_name in args.dtypes.split(","):
        engines = {q: EngineCore(engine_config(args.model, dtype_name, q), loads[q]) for q in quantizations}
        for q, engine in engines.items():
            print(f"{q}: {engine.engine_summary}", flush=True)
        hf = None if args.no_hf else hf_model_from_loaded(dense, getattr(torch, dtype_name))
        for b in map(int, args.batches.split(",")):
            batch = prompts(b, args.input_len, dense.arch.vocab_size)
            ref = (float("nan"),) * 2 if hf is None else _best(lambda: bench_hf(hf, batch, args.output_len), args.repeat)
            for q, engine in engines.items():
                ours = _best(lambda: bench_ours(engine, batch, args.output_len), args.repeat)
                results.append(Result(dtype_name, q, b, *ours, *ref))
                print(_row(results[-1]), flush=True)
                if args.profile:
                    print(f"decode profile, {dtype_name} {q}, batch {b} (8 steps):\n{profile_decode(engine, batch)}", flush=True)
    print(table(results, args))
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


def engine_config(model: str, dtype: str, quantization: str) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, quantization=quantization),
        cache=CacheConfig(kv_cache_memory_mib=256),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
    )


def cpu_flags() -> str:
    """What decides the kernels: torch's CPU dispatch level and native bf16 support."""
    return f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, avx512_bf16 {torch.cpu._is_avx512_bf16_supported()}"


def _best(fn, repeat: int) -> tuple[float, float]:
    runs = [fn() for _ in range(max(repeat, 1))]
    return max(r[0] for r in runs), max(r[1] for r in runs)


def _row(r: Result) -> str:
    return (
        f"| {r.dtype} | {r.quantization} | {r.batch} | {r.ours_prefill_tps:.0f} | {r.hf_prefill_tps:.0f} | "
        f"{r.ours_prefill_tps / r.hf_prefill_tps:.2f}x | {r.ours_decode_tps:.1f} | {r.hf_decode_tps:.1f} | "
        f"{r.ours_decode_tps / r.hf_decode_tps:.2f}x |"
    )


def table(results: list[Result], args: argparse.Namespace) -> str:
    head = (
        f"input {args.input_len} tokens, output {args.output_len} tokens, {torch.get_num_threads()} threads, "
        f"{cpu_flags()}; HF runs dense weights in the row's dtype\n\n"
        "| dtype | quantization | batch | prefill tok/s (ours) | prefill tok/s (HF) | ratio | decode tok/s (ours) | decode tok/s (HF) | ratio |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([head] + [_row(r) for r in results])
