"""Choosing the kernels: load the built csrc library once, fall back to torch (logged once) when absent."""

from __future__ import annotations

import functools

import structlog
import torch

from disagg.config import KERNEL_CHOICES
from disagg.ops import build
from disagg.ops.reference import TorchOps

log = structlog.get_logger(__name__)



class KernelsUnavailable(RuntimeError):
    """`kernels=csrc` was asked for and the library cannot be loaded (the message says why)."""


class CsrcOps:
    """The same ops as TorchOps, run by the csrc library (CPU tensors of float32 or bfloat16)."""

    def __init__(self) -> None:
        self.name = f"csrc-{torch.ops.disagg.isa()}"

    rms_norm = staticmethod(lambda x, weight, eps: torch.ops.disagg.rms_norm(x, weight, eps))
    add_rms_norm = staticmethod(lambda x, residual, weight, eps: torch.ops.disagg.add_rms_norm(x, residual, weight, eps))
    rope_and_cache = staticmethod(lambda *args: torch.ops.disagg.rope_and_cache(*args))
    silu_and_mul = staticmethod(lambda x: torch.ops.disagg.silu_and_mul(x))
    paged_decode_attention = staticmethod(lambda *args: torch.ops.disagg.paged_decode_attention(*args))
    gather_blocks = staticmethod(lambda cache, block_ids: torch.ops.disagg.gather_blocks(cache, block_ids))
    scatter_blocks = staticmethod(lambda cache, block_ids, src: torch.ops.disagg.scatter_blocks(cache, block_ids, src))


@functools.cache
def csrc_status() -> str | None:
    """None when the csrc library is loaded, else why it is not (checked once per process)."""
    path = build.library_path()
    if not path.is_file():
        return f"csrc kernels not built ({path} is missing; `make install` or `python -m disagg.ops` builds them)"
    try:
        torch.ops.load_library(str(path))
    except OSError as exc:
        return f"csrc kernels at {path} do not load: {exc}"
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
