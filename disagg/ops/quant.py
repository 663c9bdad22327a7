"""Quantized weights in one portable form: integer values, per-group scales (and mins), a pure-torch dequantize.

`QuantizedWeight` is what a loader produces and what tests compare; the matmul-ready forms (csrc
quant_matmul's blocks, `pack_blocks`; torch's int4/int8 packed layouts) are built from it by
`disagg.ops.linear.prepare_weight`. Every conversion here is exact on the integers: GGUF blocks keep
their own q values and fp16 scales (held as float32), and `dequantize` computes each value the way
gguf's own `dequantize` does (`scale * q + min`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GGUF_GROUP_SIZE = 32  # Q4_0, Q4_1 and Q8_0 blocks hold 32 values of one row
INT4_GROUP_SIZE = 32  # quantize-on-load int4: the same group as the GGUF blocks
QUANT_BLOCK = 32  # csrc quant_matmul: one scale per 32 values of an activation row and of a weight row


class QuantKind(enum.Enum):
    INT4 = "int4"  # q in 0..15, w = scale * q + min
    INT8 = "int8"  # q in -127..127 (GGUF Q8_0: -128..127), w = scale * q


@dataclass(frozen=True)
class QuantizedWeight:
    """An [out_features, in_features] weight as integers plus one scale (and min) per group of a row.

    `qweight`: INT4 → uint8 [N, K/2], column 2j in the low nibble and 2j+1 in the high one;
    INT8 → int8 [N, K]. `scales` and `mins` are float32 [N, K/group_size]; `mins` is None for INT8.
    `source` says where the integers came from ('Q4_1', 'Q8_0', 'int4 on load', ...).
    """

    kind: QuantKind
    out_features: int
    in_features: int
    group_size: int
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    source: str

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 → uint8 [N, K/2] (even column low nibble, odd column high)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] → uint8 [N, K] in 0..15: the inverse of `pack_nibbles`."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def pack_blocks(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` in the layout of csrc's quant_matmul (csrc/cpu/quant_matmul.h): (packed uint8 [tiles, K / 32,
    16 * 32 * bits / 8], scales float32 [tiles, K / 32, 2, 16] of d then m), rows in tiles of 16
    (zero-padded), one d and m per block of 32 columns. INT4: 4 chunks of 64 bytes per block, byte
    4i + j of chunk c holding column 8c + j of row i (low nibble) and column 8c + 4 + j (high). INT8:
    8 chunks, byte 4i + j of chunk c holding column 4c + j plus 128, and m = -128 d."""
    if w.group_size % QUANT_BLOCK:
        raise ValueError(f"groups of {w.group_size} columns do not split into blocks of {QUANT_BLOCK}")
    n, k = w.shape
    d = w.scales.repeat_interleave(w.group_size // QUANT_BLOCK, dim=1)
    if w.kind is QuantKind.INT4:
        m = w.mins.repeat_interleave(w.group_size // QUANT_BLOCK, dim=1)
        q = F.pad(integer_values(w), (0, 0, 0, -n % 16)).view(-1, 16, k // 32, 4, 2, 4)  # [tile, i, block, c, half, j]
        packed = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(-1, k // 32, 256)
    else:
        m = -128 * d
        q = F.pad((w.qweight.to(torch.int16) + 128).to(torch.uint8), (0, 0, 0, -n % 16)).view(-1, 16, k // 32, 8, 4)
        packed = q.permute(0, 2, 3, 1, 4).reshape(-1, k // 32, 512)  # [tile, block, c, i, j]
    scales = F.pad(torch.stack([d, m], dim=1), (0, 0, 0, 0, 0, -n % 16))  # [N, 2, blocks]
    scales = scales.view(-1, 16, 2, k // 32).permute(0, 3, 2, 1)
    return packed.contiguous(), scales.to(torch.float32).contiguous()


def unpack_blocks(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_blocks' inverse, padding rows included: (q uint8 [tiles * 16, K] as the kernel multiplies it
    (INT8: the value + 128), d and m float32 [tiles * 16, K / 32])."""
    tiles, blocks, nbytes = packed.shape
    if nbytes == 256:
        chunks = packed.view(tiles, blocks, 4, 16, 4)  # [tile, block, c, i, j]
        q = torch.stack([chunks & 0x0F, chunks >> 4], dim=-2).permute(0, 3, 1, 2, 4, 5)  # [tile, i, block, c, half, j]
    else:
        q = packed.view(tiles, blocks, 8, 16, 4).permute(0, 3, 1, 2, 4)
    d, m = scales.permute(0, 3, 2, 1).reshape(tiles * 16, 2, blocks).unbind(dim=1)
    return q.reshape(tiles * 16, blocks * 32), d.contiguous(), m.contiguous()


def integer_values(w: QuantizedWeight) -> torch.Tensor:
    """The weight's q values as an [N, K] integer tensor (uint8 for INT4, int8 for INT8)."""
    return unpack_nibbles(w.qweight) if w.kind is QuantKind.INT4 else w.qweight


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """The float32 [N, K] weight: `scale * q (+ min)` per group, the reference every kernel is tested against."""
    n, g = w.out_features, w.group_size
    q = integer_values(w).to(torch.float32).view(n, -1, g)
    out = w.scales[..., None] * q
    if w.mins is not None:
        out = out + w.mins[..., None]
    return out.view(n, w.in_features)


def _check_groups(weight: torch.Tensor, group_size: int) -> None:
    if weight.dim() != 2 or weight.shape[1] % group_size:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not split into groups of {group_size} columns")


def _safe(scale: torch.Tensor) -> torch.Tensor:
    """Divisor for quantizing: an all-zero (or constant) group has scale 0 and quantizes to q = 0."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8: scale = max|row| / 127, q = round(w / scale)."""
    w = weight.to(torch.float32)
    n, k = w.shape
    scales = w.abs().amax(dim=1, keepdim=True) / 127
    q = torch.clamp(torch.round(w / _safe(scales)), -127, 127).to(torch.int8)
    return QuantizedWeight(QuantKind.INT8, n, k, k, q.contiguous(), scales.contiguous(), None, "quantized on load")


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """Asymmetric int4 per group of `group_size` columns: min = group min, scale = (max - min) / 15."""
    _check_groups(weight, group_size)
    w = weight.to(torch.float32)
    n, k = w.shape
    groups = w.view(n, k // group_size, group_size)
    mins = groups.amin(dim=-1)
    scales = (groups.amax(dim=-1) - mins) / 15
    q = torch.clamp(torch.round((groups - mins[..., None]) / _safe(scales)[..., None]), 0, 15).view(n, k)
    return QuantizedWeight(QuantKind.INT4, n, k, group_size, pack_nibbles(q), scales, mins, "quantized on load")


def _blocks(data: torch.Tensor, rows: int, cols: int, block_bytes: int) -> torch.Tensor:
    """GGUF row-major block bytes → uint8 [rows, cols / 32, block_bytes]."""
    if cols % GGUF_GROUP_SIZE:
        raise ValueError(f"GGUF rows of {cols} values do not split into blocks of {GGUF_GROUP_SIZE}")
    expected = rows * cols // GGUF_GROUP_SIZE * block_bytes
    if data.dtype != torch.uint8 or data.numel() != expected:
        raise ValueError(f"expected {expected} uint8 bytes for a [{rows}, {cols}] tensor, got {data.numel()} {data.dtype}")
    return data.reshape(rows, cols // GGUF_GROUP_SIZE, block_bytes)


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 value at byte `start` of every block, as float32 (exact)."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].to(torch.float32)


def _gguf_nibbles(blocks: torch.Tensor, start: int, rows: int, cols: int) -> torch.Tensor:
    """The 32 q values of each block: byte j holds value j (low nibble) and value j + 16 (high)."""
    qs = blocks[..., start : start + 16]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows, cols)


def from_gguf_q4_1(data: torch.Tensor, rows: int, cols: int) -> QuantizedWeight:
    """Q4_1 blocks (fp16 d, fp16 m, 16 bytes of nibbles): w = d * q + m, kept exactly."""
    blocks = _blocks(data, rows, cols, 20)
    q = _gguf_nibbles(blocks, 4, rows, cols)
    return QuantizedWeight(QuantKind.INT4, rows, cols, GGUF_GROUP_SIZE, pack_nibbles(q), _fp16(blocks, 0), _fp16(blocks, 2), "Q4_1")


def from_gguf_q4_0(data: torch.Tensor, rows: int, cols: int) -> QuantizedWeight:
    """Q4_0 blocks (fp16 d, 16 bytes of nibbles): w = d * (q - 8) = d * q + (-8 d), kept exactly."""
    blocks = _blocks(data, rows, cols, 18)
    q = _gguf_nibbles(blocks, 2, rows, cols)
    scales = _fp16(blocks, 0)
    return QuantizedWeight(QuantKind.INT4, rows, cols, GGUF_GROUP_SIZE, pack_nibbles(q), scales, -8 * scales, "Q4_0")


def from_gguf_q8_0(data: torch.Tensor, rows: int, cols: int) -> QuantizedWeight:
    """Q8_0 blocks (fp16 d, 32 int8 values): w = d * q, kept exactly (group 32, not per channel)."""
    blocks = _blocks(data, rows, cols, 34)
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)
    return QuantizedWeight(QuantKind.INT8, rows, cols, GGUF_GROUP_SIZE, q, _fp16(blocks, 0), None, "Q8_0")


FROM_GGUF = {"Q4_0": from_gguf_q4_0, "Q4_1": from_gguf_q4_1, "Q8_0": from_gguf_q8_0}


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights of one kind and group size along the output dimension (fused q/k/v, gate/up)."""
    first = parts[0]
    if any((p.kind, p.group_size, p.in_features) != (first.kind, first.group_size, first.in_features) for p in parts):
        raise ValueError("only weights of one kind, group size and input width can be fused")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])
    source = "+".join(dict.fromkeys(p.source for p in parts))
    return QuantizedWeight(
        first.kind, sum(p.out_features for p in parts), first.in_features, first.group_size,
        torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), mins, source,
    )


def to_per_channel_int8(w: QuantizedWeight) -> QuantizedWeight:
    """An INT8 weight with one scale per row (what torch's int8 kernel takes); lossy unless it already is."""
    assert w.kind is QuantKind.INT8, "only int8 weights requantize per channel"
    if w.group_size == w.in_features:
        return w
    return dataclasses.replace(quantize_int8(dequantize(w)), source=f"{w.source} requantized")
