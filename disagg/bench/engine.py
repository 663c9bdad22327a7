"""`disagg bench engine`: prefill and decode tok/s of our engine beside HF transformers `generate()`.

Both run in the same process on the same weights and threads, taking turns a round at a time
(every form of ours, then HF, per batch size), so the ratios hold even on a noisy shared machine. HF transformers is a dev dependency: `pip install transformers`.
Each run prints the CPU's flags, the kernels chosen, and memcpy GB/s measured in the same run, from
which batch-1 decode's weight-streaming bound follows (every weight is read once per step), and
float32 matmul GFLOP/s, from which batch decode's compute bound follows (two FLOPs per weight per row).
`--peers NAME=URL ...` then drives servers the user started (disagg/bench/peers.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from disagg.cli_args import comma_list
from disagg.engine_config import GGUF_BLOCKS, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.core import EngineCore
from disagg.bench.hf_baseline import hf_model_from_loaded
from disagg.engine.loader import load_model
from disagg.ops import csrc_status
from disagg.ops.cpu import TORCH_LEVEL_VARS, cpu_features, read_flags
from disagg.ops.hugepages import HugePageArena
from disagg.types import SamplingParams


@dataclass
class Result:
    dtype: str
    kernels: str
    quantization: str
    batch: int
    ours_prefill_tps: float
    ours_decode_tps: float
    hf_prefill_tps: float
    hf_decode_tps: float
    kv_cache_dtype: str = "auto"

    @property
    def kv_label(self) -> str:
        """', kv cache bfloat16' where --kv-cache-dtype was set, else ''."""
        return "" if self.kv_cache_dtype == "auto" else f", kv cache {self.kv_cache_dtype}"

    @property
    def form(self) -> str:
        """'float32, csrc-avx512, none', and the kv_label."""
        return f"{self.dtype}, {self.kernels}, {self.quantization}{self.kv_label}"


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
    """(prefill tok/s, decode tok/s) of one `generate()`, split as bench_ours splits ours: the time to
    the first token of the whole batch, then the rest. A stopping criterion that never stops notes
    when each step's tokens were appended. (Decode was once a second generate() less the first's
    prefill: at batch 16 the 32 steps are ~2 s beside a ~7 s prefill, so the prefill's swing between
    the two calls moved HF's decode rate from 113 to 233 tok/s across runs.)"""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    clock = StepClock()
    ids = torch.tensor(batch)
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=output_len + 1, min_new_tokens=output_len + 1, do_sample=False,
                   eos_token_id=None, pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock]))
    assert len(clock.times) == output_len + 1, f"generate() took {len(clock.times)} steps, not {output_len + 1}"
    prefill_s, decode_s = clock.times[0] - start, clock.times[-1] - clock.times[0]
    return ids.numel() / prefill_s, len(batch) * output_len / max(decode_s, 1e-9)


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
    machine = machine_line()
    print(machine, flush=True)
    report = {"machine": machine, **({} if args.skip_engine else run_engine(args))}
    if args.peers:
        from disagg.bench.peers import format_table, run_peers

        peers = run_peers(args.peers, args.peer_input_len, args.peer_output_len, args.peer_sequential, args.peer_streams)
        print(format_table(peers, args.peer_streams))
        report["peers"] = [asdict(p) for p in peers]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def run_engine(args: argparse.Namespace) -> dict:
    """Every (kernels, quantization, KV cache) form of the engine beside dense HF, per dtype and batch
    size: the forms and HF take turns, a round each (best_in_rounds)."""
    quantizations = comma_list(args.quantization)
    dense = load_model(ModelConfig(model=args.model, quantization="none"))
    # gguf and gguf_float load the same blocks: one load serves both
    wants_blocks = set(quantizations) & set(GGUF_BLOCKS)
    blocks = load_model(ModelConfig(model=args.model, quantization="gguf")) if wants_blocks else None
    loads = {q: blocks if q in GGUF_BLOCKS else dense for q in quantizations}
    memcpy_gbps, read_gbps = measure_memory_gbps()
    matmul_gflops = measure_matmul_gflops()
    results, sizes = [], {}
    for dtype_name in args.dtypes.split(","):
        hf = None if args.no_hf else hf_model_from_loaded(dense, getattr(torch, dtype_name))
        forms = engine_forms(args, dtype_name, loads, sizes)
        for b in map(int, args.batches.split(",")):
            batch = prompts(b, args.input_len, dense.arch.vocab_size)
            runs = [functools.partial(run_with_isa, isa, bench_ours, engine, batch, args.output_len)
                    for engine, _, _, _, isa in forms]
            if hf is not None:
                runs.append(functools.partial(bench_hf, hf, batch, args.output_len))
            best = best_in_rounds(runs, args.repeat)
            theirs = best[-1] if hf is not None else (float("nan"), float("nan"))
            for (engine, name, q, kv, isa), ours in zip(forms, best):
                results.append(Result(dtype_name, name, q, b, *ours, *theirs, kv_cache_dtype=kv))
                print(_row(results[-1]), flush=True)
                if args.profile:
                    profile = run_with_isa(isa, profile_decode, engine, batch)
                    print(f"decode profile, {results[-1].form}, batch {b} (8 steps):\n{profile}", flush=True)
    print(table(results, args))
    print(bound_lines(results, sizes, memcpy_gbps, read_gbps))
    print(compute_bound_lines(results, sizes, matmul_gflops))
    return {"memcpy_gbps": memcpy_gbps, "read_gbps": read_gbps, "matmul_gflops": matmul_gflops,
            "engine": [asdict(r) for r in results]}


def engine_forms(args: argparse.Namespace, dtype_name: str, loads: dict, sizes: dict) -> list[tuple]:
    """Every (kernels, quantization, KV cache, instruction set) form of the engine in `dtype_name`, each
    as (engine, kernels name, quantization, kv cache dtype, csrc instruction set or None); its weight
    bytes go into `sizes`."""
    forms = []
    wrong = [pages for pages in comma_list(args.huge_pages) if pages not in ("on", "off")]
    if wrong:
        raise ValueError(f"--huge-pages takes on and off, got {wrong[0]!r}")
    for kernels, q, kv, pages in itertools.product(comma_list(args.kernels), comma_list(args.quantization),
                                                   comma_list(args.kv_cache_dtypes), comma_list(args.huge_pages)):
        for isa in isas_for(kernels, args.isas):
            with instruction_set(isa):
                engine = EngineCore(engine_config(args.model, dtype_name, kernels, q, kv, pages == "on"), loads[q])
            name = engine.runner.model.ops.name + ("" if pages == "on" else " 4K pages")
            sizes[(dtype_name, name, q)] = engine.runner.model.weight_bytes()
            forms.append((engine, name, q, kv, isa))
            print(f"{dtype_name}, {name}, {q}, kv cache {kv}: {engine.engine_summary}", flush=True)
    return forms


def isas_for(kernels: str, isas: str | None) -> list[str | None]:
    """The csrc instruction sets a `kernels` choice runs under: each of `isas` for csrc kernels (auto
    where the library is built), else [None] (the process's own)."""
    if isas is None or kernels == "torch" or (kernels == "auto" and csrc_status() is not None):
        return [None]
    return list(comma_list(isas))


@contextlib.contextmanager
def instruction_set(isa: str | None):
    """csrc's kernel table switched to `isa` for the block (None: left as it is), then back."""
    if isa is None:
        yield
        return
    before = torch.ops.disagg.isa()
    torch.ops.disagg.set_isa(isa)  # a RuntimeError names an instruction set this CPU lacks
    try:
        yield
    finally:
        torch.ops.disagg.set_isa(before)


def run_with_isa(isa: str | None, fn: Callable, *args):
    with instruction_set(isa):
        return fn(*args)


def engine_config(model: str, dtype: str, kernels: str, quantization: str, kv_cache_dtype: str = "auto",
                  huge_pages: bool = True) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, kernels=kernels, quantization=quantization, huge_pages=huge_pages),
        cache=CacheConfig(kv_cache_memory_mib=256, kv_cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
    )


def machine_line() -> str:
    """CPU model, the flags that decide the kernels and dtype, the level the engine runs as (disagg.ops.cpu,
    DISAGG_CPU_ISA included), cores and torch threads."""
    model, flags = _cpu_model(), read_flags()
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    shown = " ".join(flag for flag in wanted if flag in flags) or "none of avx2/avx512/amx"
    held = " ".join(f"{name}={os.environ[name]}" for name in TORCH_LEVEL_VARS if os.environ.get(name))
    return (f"CPU: {model}; flags: {shown}; runs as {cpu_features().describe()}; {os.cpu_count()} cores, "
            f"{torch.get_num_threads()} torch threads; torch {torch.__version__}"
            + (f" (its libraries held: {held})" if held else ""))


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return "unknown CPU"


def measure_memory_gbps(size_bytes: int = 256 * 2**20, repeat: int = 5) -> tuple[float, float]:
    """(memcpy GB/s: bytes copied per second; read GB/s: bytes summed per second), best of `repeat`,
    on buffers far larger than the caches, with the engine's threads, in 4 KB pages and in huge pages
    (where the kernel gives them; the engine's weights sit there: 17-19 -> 25 GB/s read on the Xeon
    host): the faster of the two."""
    copy_best = read_best = 0.0
    for huge in (False, True):  # one pair of buffers at a time
        shape = (size_bytes // 4,)
        src, dst = ((HugePageArena().empty(shape, torch.float32) for _ in range(2)) if huge
                    else (torch.empty(shape), torch.empty(shape)))
        src.fill_(1.0)
        for _ in range(repeat):
            start = time.perf_counter()
            dst.copy_(src)
            copy_best = max(copy_best, size_bytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            src.sum()
            read_best = max(read_best, size_bytes / (time.perf_counter() - start) / 1e9)
        del src, dst  # freed before the next pair
    return copy_best, read_best


def measure_matmul_gflops(size: int = 2048, repeat: int = 5, clock=time.perf_counter) -> float:
    """float32 GFLOP/s of torch's own matmul on square [size, size] operands, best of `repeat`, with the
    engine's threads: what this CPU's float32 multiply-adds can do now."""
    a, b = torch.ones(size, size), torch.ones(size, size)
    a @ b  # first call: the library's own set-up
    best = 0.0
    for _ in range(repeat):
        start = clock()
        a @ b
        best = max(best, 2 * size**3 / (clock() - start) / 1e9)
    return best


def bound_lines(results: list[Result], weight_bytes_of: dict[tuple[str, str, str], int], memcpy_gbps: float,
                read_gbps: float) -> str:
    """Batch-1 decode against the weight-streaming bound: GB/s over the weight bytes each step reads."""
    lines = [f"memory in this run: memcpy {memcpy_gbps:.1f} GB/s, read {read_gbps:.1f} GB/s; "
             "batch-1 decode bound = GB/s / weight bytes per step"]
    for r in results:
        if r.batch == 1:
            size = weight_bytes_of[(r.dtype, r.kernels, r.quantization)]
            copy_bound, read_bound = memcpy_gbps * 1e9 / size, read_gbps * 1e9 / size
            lines.append(f"- {r.form} ({size / 2**20:.0f} MiB of weights): {r.ours_decode_tps:.1f} tok/s = "
                         f"{r.ours_decode_tps / copy_bound:.0%} of the memcpy bound ({copy_bound:.1f} tok/s), "
                         f"{r.ours_decode_tps / read_bound:.0%} of the read bound ({read_bound:.1f} tok/s)")
    return "\n".join(lines)


def compute_bound_lines(results: list[Result], weight_bytes_of: dict[tuple[str, str, str], int],
                        matmul_gflops: float) -> str:
    """Float32 batch decode against the compute bound: every row multiplies every weight once per step
    (two FLOPs), at the float32 matmul GFLOP/s measured in this run; attention and the rest excluded."""
    lines = [f"float32 matmul in this run: {matmul_gflops:.0f} GFLOP/s; "
             "batch decode bound = GFLOP/s / (2 x weights per row)"]
    for r in results:
        if r.batch > 1 and r.dtype == "float32" and r.quantization == "none":
            weights = weight_bytes_of[(r.dtype, r.kernels, r.quantization)] // 4
            bound = matmul_gflops * 1e9 / (2 * weights)
            lines.append(f"- float32, {r.kernels}{r.kv_label}, batch {r.batch} ({weights / 1e6:.1f}M weights): {r.ours_decode_tps:.1f} tok/s "
                         f"= {r.ours_decode_tps / bound:.0%} of the compute bound ({bound:.1f} tok/s)")
    return "\n".join(lines)


Rates = tuple[float, float]  # (prefill tok/s, decode tok/s)


def best_in_rounds(runs: list[Callable[[], Rates]], repeat: int) -> list[Rates]:
    """Each run's best rates over `repeat` rounds, every run once a round in order, so that all see
    the same spells of a shared machine's load (on one host HF's batch-16 rate moved 113.8 -> 140.9
    tok/s between rows measured minutes apart)."""
    rates: list[list[Rates]] = [[] for _ in runs]
    for _ in range(max(repeat, 1)):
        for run, seen in zip(runs, rates):
            seen.append(run())
    return [_best(seen) for seen in rates]


def _best(runs: list[Rates]) -> Rates:
    return max(r[0] for r in runs), max(r[1] for r in runs)


def _row(r: Result) -> str:
    hf_ran = not math.isnan(r.hf_prefill_tps)  # --no-hf: its cells say "-", not nan
    hf_prefill, prefill_ratio = (f"{r.hf_prefill_tps:.0f}", f"{r.ours_prefill_tps / r.hf_prefill_tps:.2f}x") if hf_ran else ("-", "-")
    hf_decode, decode_ratio = (f"{r.hf_decode_tps:.1f}", f"{r.ours_decode_tps / r.hf_decode_tps:.2f}x") if hf_ran else ("-", "-")
    return (
        f"| {r.dtype} | {r.kernels} | {r.quantization} | {r.kv_cache_dtype} | {r.batch} | {r.ours_prefill_tps:.0f} | {hf_prefill} | "
        f"{prefill_ratio} | {r.ours_decode_tps:.1f} | {hf_decode} | {decode_ratio} |"
    )


def table(results: list[Result], args: argparse.Namespace) -> str:
    head = (
        f"input {args.input_len} tokens, output {args.output_len} tokens, {torch.get_num_threads()} threads; "
        "HF runs dense weights in the row's dtype\n\n"
        "| dtype | kernels | quantization | kv cache | batch | prefill tok/s (ours) | prefill tok/s (HF) | ratio "
        "| decode tok/s (ours) | decode tok/s (HF) | ratio |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([head] + [_row(r) for r in results])
