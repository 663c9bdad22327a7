"""Choosing the kernels: load the built csrc library once, fall back to torch (logged once) when absent."""

from __future__ import annotations

import functools

import structlog
import torch

from disagg.engine_config import KERNEL_CHOICES
from disagg.ops import build
from disagg.ops.cpu import Isa, cpu_features
from disagg.ops.reference import TorchOps

log = structlog.get_logger(__name__)


# Where models run quantized weights on csrc's quant_matmul rather than torch's kernels, measured on
# SmolLM2's layers at 16 rows: the avx512 build (VNNI) 2.2-2.5x torch's int4 kernel; the avx2 build
# (vpmaddubsw) 2.3x torch's kernel in its AVX2 code (ATEN_CPU_CAPABILITY=avx2). The base build runs
# (the tests use it) but shifts bytes one at a time, slower than torch's.
QUANT_MATMUL_ISAS = ("avx512", "avx2")
# Where models run dense float32 weights on csrc's dense_matmul rather than oneDNN's packed linear:
# SmolLM2's matmuls at 16 rows, avx512 14.4-17.0 vs 19.2-20.2 ms; the avx2 build against oneDNN held
# to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) 28.4 vs 32.7 ms (docs/engine.md).
DENSE_MATMUL_ISAS = ("avx512", "avx2")


class KernelsUnavailable(RuntimeError):
    """`kernels=csrc` was asked for and the library cannot be loaded (the message says why)."""


class CsrcOps:
    """The same ops as TorchOps, run by the csrc library (CPU tensors of float32 or bfloat16).
    The attributes are the torch.ops.disagg overloads themselves: no Python layer on the hot path."""

    def __init__(self) -> None:
        ops = torch.ops.disagg
        self.name = f"csrc-{ops.isa()}"
        self.rms_norm = ops.rms_norm
        self.add_rms_norm = ops.add_rms_norm
        self.rope_and_cache = ops.rope_and_cache
        self.silu_and_mul = ops.silu_and_mul
        self.paged_decode_attention = ops.paged_decode_attention
        self.paged_prefill_attention = ops.paged_prefill_attention
        self.quantize_q8 = ops.quantize_q8
        self.quant_matmul = ops.quant_matmul
        self.quant_matmul_preferred = ops.isa() in QUANT_MATMUL_ISAS
        self.dequant_matmul = ops.dequant_matmul
        self.dense_matmul = ops.dense_matmul
        self.dense_matmul_preferred = ops.isa() in DENSE_MATMUL_ISAS
        self.argmax_rows = ops.argmax_rows
        self.gather_blocks = ops.gather_blocks
        self.scatter_blocks = ops.scatter_blocks


@functools.cache
def csrc_status() -> str | None:
    """None when the csrc library is loaded, else why it is not (checked once per process). Loaded, it
    runs the best build the CPU has, or the level DISAGG_CPU_ISA caps it at (disagg.ops.cpu)."""
    path = build.library_path()
    if not path.is_file():
        return f"csrc kernels not built ({path} is missing; `make install` or `python -m disagg.ops` builds them)"
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        return f"csrc kernels at {path} do not load: {exc}"
    cap = cpu_features().isa
    if Isa(torch.ops.disagg.isa()).rank > cap.rank:
        torch.ops.disagg.set_isa(cap.value)
    return None


def load_ops(kernels: str = "auto", device: str = "cpu"):
    """The ops for `kernels` ('auto': csrc on CPU when built, else torch; 'csrc'; 'torch') on `device`."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
    if kernels == "torch":
        return TorchOps()
    on_cpu = torch.device(device).type == "cpu"
    why = csrc_status() if on_cpu else "csrc kernels are built for the CPU only"
    if why is None:
        return CsrcOps()
    if kernels == "csrc":
        raise KernelsUnavailable(why)
    _log_fallback_once(why)
    return TorchOps()


@functools.cache
def _log_fallback_once(why: str) -> None:
    log.warning("kernels_fallback", kernels="torch", reason=why)
