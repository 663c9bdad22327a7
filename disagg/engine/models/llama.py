"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2/3) over a paged KV cache.

Functional: weights are plain tensors, the forward pass works on a flat batch of tokens from many
requests. Numerics follow HF transformers (RMSNorm in float32, RoPE tables in float32 cast to the
model dtype, rotate-half RoPE) so greedy outputs match it token for token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from disagg.engine.models.arch import LlamaArch
from disagg.engine.models.linear_weights import describe_weights, linear_weight
from disagg.ops.linear import PackedWeight, linear
from disagg.ops.quant import QuantizedWeight


@dataclass
class DecodeGroup:
    """Requests computing one token each, attended in one batched call."""

    num_tokens: int  # rows [0, num_tokens) of the flat batch
    block_tables: torch.Tensor  # [n, max_blocks] long (padded with a valid block id)
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool: True where NOT attended (padding)


@dataclass
class PrefillSegment:
    """One request computing a chunk of tokens (rows [row_start, row_end) of the flat batch)."""

    row_start: int
    row_end: int
    start_pos: int  # position of the chunk's first token; > 0 means earlier KV is in the cache
    block_ids: torch.Tensor  # [num_blocks] long


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_blocks: torch.Tensor  # [T] long: block id where each token's KV goes
    slot_offsets: torch.Tensor  # [T] long: offset inside that block
    decode: DecodeGroup | None
    prefills: list[PrefillSegment]
    logit_rows: torch.Tensor  # [R] long: rows whose logits are wanted


_LINEARS = ("qkv", "o", "gate_up", "down")  # the matmul weights of a layer (dense or PackedWeight)


def rope_inv_freq(arch: LlamaArch) -> torch.Tensor:
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_scaling is None:
        return inv_freq
    factor, low_ff, high_ff, old_len = arch.rope_scaling
    low_wavelen = old_len / low_ff
    high_wavelen = old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class LlamaModel:
    """Weights plus the forward pass. `kv_cache` is [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]."""

    def __init__(self, arch: LlamaArch, weights: Mapping[str, torch.Tensor], dtype: torch.dtype, device: str,
                 quantization: str = "none", quantized: Mapping[str, QuantizedWeight] | None = None):
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        source = {**weights, **(quantized or {})}  # a GGUF's kept blocks replace those dense weights
        self.layers = [self._layer_weights(source, i) for i in range(arch.num_layers)]
        self.embed = self._w(weights["model.embed_tokens.weight"])
        self.norm = self._w(weights["model.norm.weight"])
        head = source.get("lm_head.weight")  # None: tied to the embedding
        if head is None and quantization == "none":
            self.lm_head = self.embed
        else:
            self.lm_head = self._linear([weights["model.embed_tokens.weight"] if head is None else head])
        self.inv_freq = rope_inv_freq(arch).to(self.device)
        self.scale = arch.head_dim**-0.5
        linears = [layer[k] for layer in self.layers for k in _LINEARS]
        self.matmul_weights = describe_weights([*linears, self.lm_head])  # for the ready line

    def _w(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def _linear(self, parts: list) -> torch.Tensor | PackedWeight:
        return linear_weight(parts, self.quantization, self.dtype, self.device)

    def _layer_weights(self, w: Mapping, i: int) -> dict:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out = {
            "in_norm": self._w(w[p + "input_layernorm.weight"]),
            "post_norm": self._w(w[p + "post_attention_layernorm.weight"]),
            "qkv": self._linear([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
            "o": self._linear([w[a + "o_proj.weight"]]),
            "gate_up": self._linear([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
            "down": self._linear([w[p + "mlp.down_proj.weight"]]),
        }
        if self.arch.attention_bias:
            out["qkv_bias"] = self._w(torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]]))
        if self.arch.qk_norm:
            out["q_norm"] = self._w(w[a + "q_norm.weight"])
            out["k_norm"] = self._w(w[a + "k_norm.weight"])
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.arch.rms_norm_eps)
        return weight * x32.to(x.dtype)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Run the batch, write its KV into the cache, return float32 logits of `logit_rows`."""
        x = F.embedding(batch.token_ids, self.embed)
        cos, sin = self.rope_tables(batch.positions)
        for i, layer in enumerate(self.layers):
            x = x + self.attention(layer, self.rms_norm(x, layer["in_norm"]), cos, sin, batch, kv_cache[:, i])
            x = x + self.mlp(layer, self.rms_norm(x, layer["post_norm"]))
        x = self.rms_norm(x[batch.logit_rows], self.norm)
        return linear(x, self.lm_head).float()

    def mlp(self, layer: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        gate, up = linear(h, layer["gate_up"]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, layer["down"])

    def attention(self, layer, h, cos, sin, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        arch = self.arch
        num_q = arch.num_heads * arch.head_dim
        num_kv = arch.num_kv_heads * arch.head_dim
        qkv = linear(h, layer["qkv"], layer.get("qkv_bias"))
        q = qkv[:, :num_q].view(-1, arch.num_heads, arch.head_dim)
        k = qkv[:, num_q : num_q + num_kv].view(-1, arch.num_kv_heads, arch.head_dim)
        v = qkv[:, num_q + num_kv :].view(-1, arch.num_kv_heads, arch.head_dim)
        if arch.qk_norm:
            q = self.rms_norm(q, layer["q_norm"])
            k = self.rms_norm(k, layer["k_norm"])
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache, v_cache = cache[:, 0], cache[:, 1]  # [num_blocks, block_size, kv_heads, head_dim]
        k_cache[batch.slot_blocks, batch.slot_offsets] = k
        v_cache[batch.slot_blocks, batch.slot_offsets] = v
        out = torch.empty_like(q)
        if batch.decode is not None:
            n = batch.decode.num_tokens
            out[:n] = self._decode_attention(q[:n], k_cache, v_cache, batch.decode)
        for seg in batch.prefills:
            rows = slice(seg.row_start, seg.row_end)
            out[rows] = self._prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seg)
        return linear(out.view(-1, num_q), layer["o"])

    def _decode_attention(self, q, k_cache, v_cache, group: DecodeGroup) -> torch.Tensor:
        # Plain batched matmuls: for one query token, CPU SDPA kernels cost far more than the math.
        n = q.shape[0]
        kv_heads, dim = self.arch.num_kv_heads, self.arch.head_dim
        keys = gather_blocks(k_cache, group.block_tables).view(n, -1, kv_heads, dim).transpose(1, 2).contiguous()
        values = gather_blocks(v_cache, group.block_tables).view(n, -1, kv_heads, dim).transpose(1, 2).contiguous()
        q = q.view(n, kv_heads, -1, dim)  # query heads grouped by their KV head
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale  # [n, kv, group, L]
        scores.masked_fill_(group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).view(n, -1, dim)

    def _prefill_attention(self, q, k, v, k_cache, v_cache, seg: PrefillSegment) -> torch.Tensor:
        num_new = q.shape[0]
        if seg.start_pos == 0:
            keys, values, mask, causal = k, v, None, True
        else:
            ctx = seg.start_pos + num_new
            keys = gather_blocks(k_cache, seg.block_ids).flatten(0, 1)[:ctx]
            values = gather_blocks(v_cache, seg.block_ids).flatten(0, 1)[:ctx]
            rows = torch.arange(num_new, device=q.device)[:, None] + seg.start_pos
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= rows, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True,
        )
        return out.transpose(0, 1)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy the given blocks out of one layer's strided cache view (index_select is the fast path)."""
    return cache.index_select(0, block_ids.reshape(-1))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
