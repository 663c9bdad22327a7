"""The pure-torch twin of every csrc kernel: the fallback, and what tests/unit/test_ops.py compares against.

Each op rounds where the model's original torch code rounds (bfloat16 products and sums), so that
the engine's greedy outputs match HF transformers token for token on this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disagg.ops.linear import unpack_tiles
from disagg.ops.quant import unpack_blocks


class TorchOps:
    """The forward pass's fused ops, written with plain torch calls (any device)."""

    name = "torch"
    quant_matmul_preferred = False  # its twin below is for tests: models keep torch's kernels here
    dense_matmul_preferred = False  # likewise: models keep oneDNN or F.linear here

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x in place; returns rms_norm(residual)."""
        residual.add_(x)
        return TorchOps.rms_norm(residual, weight, eps)

    @staticmethod
    def rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, slot_blocks, slot_offsets) -> None:
        """Rotate-half RoPE of q and k in place ([T, heads, head_dim]); write k and v into the caches' slots
        (rounded to the caches' dtype)."""
        half = q.shape[-1] // 2
        table = cos_sin[positions]
        cos = torch.cat((table[:, :half], table[:, :half]), dim=-1).to(q.dtype)[:, None, :]
        sin = torch.cat((table[:, half:], table[:, half:]), dim=-1).to(q.dtype)[:, None, :]
        q.copy_(q * cos + rotate_half(q) * sin)
        k.copy_(k * cos + rotate_half(k) * sin)
        k_cache[slot_blocks, slot_offsets] = k.to(k_cache.dtype)
        v_cache[slot_blocks, slot_offsets] = v.to(v_cache.dtype)

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
        """q [n, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim] (q's dtype or a
        narrower one: read as q's); one query token per row."""
        # Plain batched matmuls over gathered blocks: for one query token, CPU SDPA costs far more than the math.
        n, _, dim = q.shape
        block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
        keys = k_cache.index_select(0, block_tables.reshape(-1)).to(q.dtype).view(n, -1, kv_heads, dim).transpose(1, 2)
        values = v_cache.index_select(0, block_tables.reshape(-1)).to(q.dtype).view(n, -1, kv_heads, dim).transpose(1, 2)
        q = q.reshape(n, kv_heads, -1, dim)  # query heads grouped by their KV head
        scores = torch.matmul(q, keys.contiguous().transpose(-1, -2)).float() * scale  # [n, kv, group, L]
        span = torch.arange(block_tables.shape[1] * block_size, device=q.device)
        scores.masked_fill_((span[None, :] >= context_lens[:, None])[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values.contiguous()).view(n, -1, dim)

    @staticmethod
    def paged_prefill_attention(q, k_cache, v_cache, block_ids, start_pos: int, scale: float) -> torch.Tensor:
        """q [T, heads, head_dim] of tokens at positions start_pos + t, each attending causally to keys
        [0, its position] in the blocks of block_ids; scores and probabilities in float32."""
        num_tokens, heads, dim = q.shape
        ctx, kv_heads = start_pos + num_tokens, k_cache.shape[2]
        keys = k_cache.index_select(0, block_ids.reshape(-1)).flatten(0, 1)[:ctx].float().permute(1, 2, 0)
        values = v_cache.index_select(0, block_ids.reshape(-1)).flatten(0, 1)[:ctx].float().transpose(0, 1)
        queries = q.float().view(num_tokens, kv_heads, -1, dim).permute(1, 2, 0, 3) * scale  # [kv, group, T, dim]
        scores = queries @ keys[:, None]  # [kv, group, T, ctx]
        positions = torch.arange(num_tokens, device=q.device)[:, None] + start_pos
        scores.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > positions, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ values[:, None]
        return out.permute(2, 0, 1, 3).reshape(num_tokens, heads, dim).to(q.dtype)

    @staticmethod
    def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [rows, k] to int8 in blocks of 32 values: q int8 [rows, k], and float32 [rows, k / 32] d
        (max|x| / 127, NaN where the block has one) and s (d * the block's sum of q), with
        q = round(x * (1 / d)) clamped to -127..127 and NaN as 0 (0 where d = 0)."""
        rows = x.shape[0]
        blocks = x.float().view(rows, x.shape[1] // 32, 32)
        d = blocks.abs().amax(dim=-1) / 127
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.nan_to_num(torch.round(blocks * inv[..., None]), nan=0.0).clamp(-127, 127)
        return q.to(torch.int8).view(rows, -1), d, d * q.sum(dim=-1)

    @staticmethod
    def quant_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        """x [rows, k] @ a weight [n, k] of `bits` (quant.pack_blocks' layout) → [rows, n] in x's dtype, with
        x rounded by quantize_q8: per block b, acc += float(sum(q * qx)) * (d * dx), then acc += m * sx."""
        assert weight.shape[2] == 16 * 32 * bits // 8, "the weight's blocks are not of this many bits"
        q, dx, sx = TorchOps.quantize_q8(x)
        values, d, m = unpack_blocks(weight, scales)
        rows, blocks = dx.shape
        qx = q.view(rows, blocks, 32).transpose(0, 1).to(torch.int64)  # [blocks, rows, 32]
        isum = torch.bmm(qx, values.view(-1, blocks, 32).transpose(0, 1).transpose(1, 2).to(torch.int64))
        acc = torch.zeros(rows, values.shape[0])
        for b in range(blocks):  # in order, one rounding per op, as the kernel sums
            acc = acc + isum[b].to(torch.float32) * (d[None, :, b] * dx[:, b, None])
            acc = acc + m[None, :, b] * sx[:, b, None]
        return acc[:, :n].to(x.dtype)

    @staticmethod
    def dequant_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        """x [rows, k] @ a weight [n, k] of `bits` (quant.pack_blocks' layout) dequantized as
        quant.dequantize computes it (4 bits d * q + m, 8 bits d * (q - 128)), in float32 → [rows, n]
        in x's dtype."""
        assert weight.shape[2] == 16 * 32 * bits // 8, "the weight's blocks are not of this many bits"
        values, d, m = unpack_blocks(weight, scales)
        d, m = d.repeat_interleave(32, dim=1), m.repeat_interleave(32, dim=1)
        w = values.float() * d + m if bits == 4 else (values.to(torch.int16) - 128).float() * d
        return F.linear(x.float(), w[:n]).to(x.dtype)

    @staticmethod
    def dense_matmul(x: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
        """x [rows, k] float32 @ a float32 or bfloat16 weight [n, k] in tiles of 32 (linear.pack_tiles) →
        [rows, n] float32."""
        return F.linear(x, unpack_tiles(weight, n).float())

    @staticmethod
    def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
        """Each row's index of its largest value: the first of equal ones, the first NaN where there is one."""
        return logits.argmax(dim=-1)

    @staticmethod
    def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """A packed copy of the given blocks (dimension 0) of a strided cache view."""
        return cache.index_select(0, block_ids.reshape(-1))

    @staticmethod
    def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """cache[block_ids[i]] = src[i]."""
        cache.index_copy_(0, block_ids.reshape(-1), src)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(inv_freq: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[num_positions, head_dim] float32: cos(p * inv_freq) then sin(p * inv_freq) for each position p."""
    freqs = torch.arange(num_positions, device=inv_freq.device).float()[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
