"""`linear`: one matmul entry point for every weight of the model, dense or quantized.

A quantized weight runs as a `PackedWeight`: a `QuantizedWeight` moved into the layout of the kernel
that multiplies it. Where csrc runs its avx512 (VNNI) or avx2 code every quantized weight runs on
`quant_matmul` (`prepare_weight(..., quant_matmul=...)`): activations rounded to int8 in blocks of
32, llama.cpp's Q4_1 x Q8_1 math, 2.2x torch's int4 kernel at 16 rows and 1.6x a dequantized
bfloat16 GEMM at 256 (docs/engine.md). Otherwise (`--kernels torch`, a CPU without AVX2) each kernel
sits behind one function (`int4_matmul`, `int8_matmul`): torch's own CPU ops, fed bfloat16
activations: with float32 activations the same ops fall back to scalar code that is 30-50x slower
(measured on SmolLM2's shapes), so x is cast to bfloat16 for the product and the result back to x's
dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.ops.cpu import cpu_features
from disagg.ops.quant import (
    QUANT_BLOCK, QuantizedWeight, QuantKind, integer_values, pack_blocks, to_per_channel_int8,
)

ACTIVATION_DTYPE = torch.bfloat16
_INT4_ROW_MULTIPLE = 16  # torch's int4 packing wants the output dimension in multiples of 16
# (x [M, K], packed weight, scales, N, bits) -> [M, N] in x's dtype: csrc's quant_matmul or its twin.
QuantMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class PackedWeight:
    """A quantized [out_features, in_features] weight in its kernel's layout.

    With `quant_matmul`: `packed` and `scales` are in that kernel's layout (quant.pack_blocks: tiles
    of 16 rows, a float32 d and m per block of 32 columns) and it multiplies them.
    Otherwise torch's kernels, in their layouts:
    INT4: `packed` is torch's int4pack layout (rows padded to a multiple of 16) and `scales` is
    [K / group_size, padded N, 2] of (scale, zero) with w = (q - 8) * scale + zero.
    INT8: `packed` is int8 [N, K] and `scales` is [N] (one per output channel).
    Scales are in `ACTIVATION_DTYPE`: torch's kernels take them in the activations' dtype.
    """

    kind: QuantKind
    out_features: int
    in_features: int
    group_size: int
    packed: torch.Tensor
    scales: torch.Tensor
    source: str
    quant_matmul: QuantMatmul | None = None
    float_activations: bool = False  # quant_matmul is csrc's dequant_matmul, not its int8 kernel

    @property
    def bits(self) -> int:
        return 4 if self.kind is QuantKind.INT4 else 8

    @property
    def kernel(self) -> str:
        if self.quant_matmul is not None and self.float_activations:
            return "csrc dequant_matmul, float32 activations"
        if self.quant_matmul is not None:
            return f"csrc quant_matmul, int8 activations in blocks of {QUANT_BLOCK}"
        return f"torch {self.kind.value}pack, {dtype_name(ACTIVATION_DTYPE)} activations"


@dataclass(frozen=True)
class OnednnWeight:
    """A dense [out_features, in_features] weight reordered into oneDNN's blocked layout.

    torch's mkldnn linear on a pre-reordered weight is 2-3.5x faster than F.linear for float32 on
    this project's CPUs at every batch size (1 to 2048 rows), and up to 2x for bfloat16 (measured
    on SmolLM2's shapes; docs/benchmarks.md). Same float32 math, summed in another order.
    """

    packed: torch.Tensor
    out_features: int
    in_features: int
    dtype: torch.dtype
    widened: bool = False  # a bfloat16 weight held as float32: oneDNN has no bf16 path on this CPU

    kernel = "oneDNN packed"


_ONEDNN_BATCH_HINT = 16  # the reorder's expected rows; 1, 16 and 256 measured within 10% at every M

TILE_ROWS = 32  # csrc dense_matmul's tile: 32 output rows
# From this many rows tiled_matmul hands a call to oneDNN: where the unpack and reorder cost less than
# dense_matmul gives away to oneDNN's GEMM. SmolLM2's four layer matmuls, two threads, dense_matmul's
# time over the hand-off's (its bare later passes, docs/engine.md): 1024 rows 0.87 (avx2) and 0.95 (avx512),
# 2048 0.97-0.98, 3072 1.03, 4096 1.05-1.06. The engine's default step budget, 1024 tokens, stays in
# dense_matmul.
TILED_MAX_ROWS = 2048
# (x [M, K] float32, packed weight, N) -> [M, N] float32: csrc's dense_matmul or its twin.
DenseMatmul = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class TiledWeight:
    """A dense float32 or bfloat16 [out_features, in_features] weight in csrc dense_matmul's layout:
    [tiles, in, 32], column i of a tile's 32 output rows contiguous (pack_tiles); the kernel computes
    in float32 (a bfloat16 weight widened in registers). Decode streams each weight once per
    step; this layout and a kernel that reads it front to back, fetching ahead, took SmolLM2's
    matmuls at 16 rows from 19.2-20.2 ms (oneDNN packed) to 14.4-17.0 (docs/engine.md)."""

    packed: torch.Tensor
    out_features: int
    in_features: int
    matmul: DenseMatmul

    kernel = "csrc dense_matmul"

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype


# Every form a matmul weight takes (linear() runs each).
Weight = torch.Tensor | PackedWeight | OnednnWeight | TiledWeight


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """[n, k] → [ceil(n / 32), k, 32]: out row 32 t + j, column i at [t, i, j]; rows past n are zero."""
    n, k = w.shape
    padded = F.pad(w, (0, 0, 0, -n % TILE_ROWS))
    return padded.view(-1, TILE_ROWS, k).transpose(1, 2).contiguous()


def unpack_tiles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_tiles undone: the [n, k] weight."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


def pack_dense(w: torch.Tensor, dense_matmul: DenseMatmul | None = None) -> torch.Tensor | OnednnWeight | TiledWeight:
    """`w` for its fastest kernel that this CPU runs (disagg.ops.cpu): with `dense_matmul` (an ops'
    `dense_matmul`) a float32 weight, or a bfloat16 one where the CPU has no native bf16, in its tiles
    (bfloat16 tiles are widened to float32 in registers); else oneDNN's layout where torch's CPU build
    has it (bfloat16 only where oneDNN's bf16 path runs here, else the weight as float32); else `w`."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return w
    cpu = cpu_features()
    if dense_matmul is not None and (w.dtype == torch.float32 or not cpu.native_bf16):
        return TiledWeight(pack_tiles(w), w.shape[0], w.shape[1], dense_matmul)
    if not torch.backends.mkldnn.is_available():
        return w
    widened = w.dtype == torch.bfloat16 and not cpu.onednn_bf16
    if widened:
        w = w.float()  # float32 compute: torch's bf16 matmul without AVX-512 is emulated, 3-8x slower
    packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _ONEDNN_BATCH_HINT)
    return OnednnWeight(packed, w.shape[0], w.shape[1], w.dtype, widened)


def prepare_weight(w: QuantizedWeight, device: torch.device | str = "cpu",
                   quant_matmul: QuantMatmul | None = None, float_activations: bool = False) -> PackedWeight:
    """The kernel-ready form of `w` (CPU only). With `quant_matmul` (an ops' `quant_matmul`, or its
    `dequant_matmul` with `float_activations`), a weight whose groups split into blocks of 32 runs on
    it, its integers and scales as they are; otherwise torch's int4/int8 packed CPU ops."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantized weights run on CPU only, not on {device}")
    if quant_matmul is not None and w.group_size % QUANT_BLOCK == 0:
        packed, scales = pack_blocks(w)
        return PackedWeight(w.kind, w.out_features, w.in_features, w.group_size, packed, scales, w.source,
                            quant_matmul=quant_matmul, float_activations=float_activations)
    if w.kind is QuantKind.INT8:
        w = to_per_channel_int8(w)
    return _prepare_int4(w) if w.kind is QuantKind.INT4 else _prepare_int8(w)


def _prepare_int4(w: QuantizedWeight) -> PackedWeight:
    n = w.out_features
    pad = -n % _INT4_ROW_MULTIPLE
    q = F.pad(integer_values(w).to(torch.int32), (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # torch's convention: w = (q - 8) * scale + zero, so zero = min + 8 * scale.
    zeros = w.mins + 8 * w.scales
    scales_zeros = torch.stack([w.scales.t(), zeros.t()], dim=-1)  # [K / group, N, 2]
    scales_zeros = F.pad(scales_zeros, (0, 0, 0, pad)).to(ACTIVATION_DTYPE).contiguous()
    return PackedWeight(QuantKind.INT4, n, w.in_features, w.group_size, packed, scales_zeros, w.source)


def _prepare_int8(w: QuantizedWeight) -> PackedWeight:
    scales = w.scales.reshape(-1).to(ACTIVATION_DTYPE).contiguous()
    return PackedWeight(QuantKind.INT8, w.out_features, w.in_features, w.in_features, w.qweight.contiguous(), scales, w.source)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) for a dense [out, in] weight, an `OnednnWeight`, a `TiledWeight` or a
    `PackedWeight`; the result has x's dtype."""
    if isinstance(weight, TiledWeight):
        return tiled_matmul(x, weight, bias)
    if isinstance(weight, OnednnWeight):
        return onednn_matmul(x, weight, bias)
    if not isinstance(weight, PackedWeight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, weight.in_features)
    if weight.quant_matmul is not None:
        out = weight.quant_matmul(rows, weight.packed, weight.scales, weight.out_features, weight.bits)
    else:
        out = (int4_matmul if weight.kind is QuantKind.INT4 else int8_matmul)(rows, weight)
    out = out.view(*x.shape[:-1], weight.out_features)
    return out if bias is None else out + bias


def onednn_matmul(x: torch.Tensor, w: OnednnWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., K] @ [N, K].T (+ bias) → [..., N] with torch's mkldnn linear on the reordered weight, in
    the weight's dtype (float32 for a bfloat16 model's weight where oneDNN has no bf16 path here)."""
    rows = x.reshape(-1, w.in_features)
    if rows.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], w.out_features)
    bias = None if bias is None else bias.to(w.dtype)
    out = torch.ops.mkldnn._linear_pointwise(rows.to(w.dtype).contiguous(), w.packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], w.out_features).to(x.dtype)


def tiled_matmul(x: torch.Tensor, w: TiledWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[..., K] @ [N, K].T (+ bias) → [..., N] in x's dtype, computed in float32: csrc dense_matmul below
    `TILED_MAX_ROWS` rows; from there oneDNN on the weight unpacked (as float32) and reordered for the
    call (two transient copies of the weight; F.linear on the unpacked weight where torch has no oneDNN)."""
    flat = x.dim() == 2 and x.dtype == torch.float32  # the float32 model's case: no reshape, view or cast
    rows = x if flat else x.reshape(-1, w.in_features).float()
    if rows.shape[0] < TILED_MAX_ROWS:
        out = w.matmul(rows, w.packed, w.out_features)
    elif torch.backends.mkldnn.is_available():
        dense = unpack_tiles(w.packed, w.out_features).float().contiguous()
        reordered = torch.ops.mkldnn._reorder_linear_weight(dense, rows.shape[0])
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), reordered, None, "none", [], "")
    else:
        out = F.linear(rows, unpack_tiles(w.packed, w.out_features).float())
    if not flat:
        out = out.view(*x.shape[:-1], w.out_features).to(x.dtype)
    return out if bias is None else out + bias


def int4_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """[M, K] @ int4 [N, K].T → [M, N] in x's dtype (torch's int4pack CPU kernel)."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(ACTIVATION_DTYPE), w.packed, w.group_size, w.scales)
    if out.shape[1] != w.out_features:
        out = out[:, : w.out_features].contiguous()
    return out.to(x.dtype)


def int8_matmul(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """[M, K] @ int8 [N, K].T → [M, N] in x's dtype (torch's int8pack CPU kernel, per-channel scales)."""
    return torch.ops.aten._weight_int8pack_mm(x.to(ACTIVATION_DTYPE), w.packed, w.scales).to(x.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: as the CLI, the ready line and the KV layout spell it."""
    return str(dtype).removeprefix("torch.")
