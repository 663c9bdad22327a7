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
from disagg.engine.models.tensor_parallel import Collectives
from disagg.engine.models.linear_weights import describe_weights, linear_weight, placed
from disagg.ops import load_ops
from disagg.ops.hugepages import HugePageArena
from disagg.ops.linear import OnednnWeight, PackedWeight, TiledWeight, Weight, linear
from disagg.ops.quant import QuantizedWeight
from disagg.ops.reference import rope_cos_sin


@dataclass
class DecodeGroup:
    """Requests computing one token each, attended in one batched call."""

    num_tokens: int  # rows [0, num_tokens) of the flat batch
    block_tables: torch.Tensor  # [n, max_blocks] long (padded with a valid block id)
    context_lens: torch.Tensor  # [n] long: tokens each row attends to, its new one included


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
# csrc's paged_prefill_attention takes these head sizes and up to 64 query heads per KV head (2x
# torch's CPU flash kernel on SmolLM2's shapes, docs/engine.md); others run torch's
# scaled_dot_product_attention.
CSRC_PREFILL_HEAD_DIMS = (64, 128)
CSRC_PREFILL_MAX_GROUP = 64


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
                 quantization: str = "none", quantized: Mapping[str, QuantizedWeight] | None = None,
                 kernels: str = "auto", tp: Collectives | None = None, huge_pages: bool = True):
        """`tp`: this rank's tensor-parallel group; `arch` and `weights` are then the rank's shard
        (tensor_parallel.py), and the layer outputs and logits are combined across the group.
        `huge_pages`: csrc's packed weights in transparent huge pages on CPU (disagg.ops.hugepages)."""
        self.arch = arch
        self.tp = tp
        self.dtype = dtype
        self.device = torch.device(device)
        self.quantization = quantization
        self.ops = load_ops(kernels, device)
        self.packed = self.ops.name != "torch"  # the reference path keeps F.linear, as HF computes
        # Quantized weights run on csrc's quant_matmul (int8 activations) where it is the fast kernel;
        # gguf_float's on csrc's dequant_matmul (float32 activations) on the same CPUs, dense elsewhere.
        if quantization == "gguf_float":
            self._quant_matmul = self.ops.dequant_matmul if self.ops.quant_matmul_preferred else None
        else:
            self._quant_matmul = self.ops.quant_matmul if self.ops.quant_matmul_preferred else None
        # Dense float32 weights run on csrc's dense_matmul where it beats oneDNN (decode's few rows).
        self._dense_matmul = self.ops.dense_matmul if self.ops.dense_matmul_preferred else None
        self._csrc_prefill = (self.packed and arch.head_dim in CSRC_PREFILL_HEAD_DIMS
                              and arch.num_heads // arch.num_kv_heads <= CSRC_PREFILL_MAX_GROUP)
        source = {**weights, **(quantized or {})}  # a GGUF's kept blocks replace those dense weights
        self.huge_pages = huge_pages and self.device.type == "cpu"
        self._arena = HugePageArena() if self.huge_pages else None  # only while the weights are placed
        self.layers = [self._layer_weights(source, i) for i in range(arch.num_layers)]
        self.embed = self._w(weights["model.embed_tokens.weight"])
        self.norm = self._w(weights["model.norm.weight"])
        head = source.get("lm_head.weight")  # None: tied to the embedding
        if head is None and quantization == "none" and not self.packed:
            self.lm_head = self.embed
        else:
            self.lm_head = self._linear([weights["model.embed_tokens.weight"] if head is None else head])
        self.inv_freq = rope_inv_freq(arch).to(self.device)
        self._cos_sin = rope_cos_sin(self.inv_freq, min(arch.max_position_embeddings, 4096))
        self.scale = arch.head_dim**-0.5
        self.huge_page_bytes = 0 if self._arena is None else self._arena.placed_bytes  # weights placed there
        self._arena = None
        linears = [layer[k] for layer in self.layers for k in _LINEARS]
        self.matmul_weights = describe_weights([*linears, self.lm_head])  # for the ready line

    def _w(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def weight_bytes(self) -> int:
        """Bytes of the matmul weights one decode step reads (every layer's and the LM head; not the embedding)."""
        linears = [layer[k] for layer in self.layers for k in _LINEARS] + [self.lm_head]
        return sum(_nbytes(w) for w in linears)

    def _linear(self, parts: list) -> Weight:
        return placed(linear_weight(parts, self.quantization, self.dtype, self.device, self.packed,
                                    self._quant_matmul, self._dense_matmul), self._arena)

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

    def cos_sin(self, num_positions: int) -> torch.Tensor:
        """The RoPE table covering positions [0, num_positions), grown by doubling as contexts get longer."""
        if self._cos_sin.shape[0] < num_positions:
            size = min(max(num_positions, 2 * self._cos_sin.shape[0]), max(self.arch.max_position_embeddings, num_positions))
            self._cos_sin = rope_cos_sin(self.inv_freq, size)
        return self._cos_sin

    def layer_caches(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k_cache, v_cache) view of `kv_cache` ([num_blocks, block_size, kv_heads, head_dim]).
        The runner keeps them beside the cache: three slicing calls per layer and step less."""
        return [(kv_cache[:, i, 0], kv_cache[:, i, 1]) for i in range(self.arch.num_layers)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor,
                caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Run the batch, write its KV into the cache, return float32 logits of `logit_rows`."""
        ops, eps = self.ops, self.arch.rms_norm_eps
        caches = caches or self.layer_caches(kv_cache)
        cos_sin = self.cos_sin(int(batch.positions.max()) + 1)
        residual = F.embedding(batch.token_ids, self.embed)
        h = ops.rms_norm(residual, self.layers[0]["in_norm"], eps)
        for i, layer in enumerate(self.layers):
            if i:
                h = ops.add_rms_norm(x, residual, layer["in_norm"], eps)  # residual += the last MLP's output
            x = self._reduced(self.attention(layer, h, cos_sin, batch, *caches[i]))
            h = ops.add_rms_norm(x, residual, layer["post_norm"], eps)
            x = self._reduced(self.mlp(layer, h))
        residual.add_(x)
        h = ops.rms_norm(residual[batch.logit_rows], self.norm, eps)
        logits = linear(h, self.lm_head)
        return (logits if self.tp is None else self.tp.all_gather(logits)).float()

    def _reduced(self, x: torch.Tensor) -> torch.Tensor:
        """A row-split projection's partial sums added across the TP group (nothing to do alone)."""
        return x if self.tp is None else self.tp.all_reduce(x)

    def mlp(self, layer: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return linear(self.ops.silu_and_mul(linear(h, layer["gate_up"])), layer["down"])

    def attention(self, layer, h, cos_sin, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        arch, ops = self.arch, self.ops
        num_q = arch.num_heads * arch.head_dim
        qkv = linear(h, layer["qkv"], layer.get("qkv_bias"))
        q, k, v = qkv.view(-1, arch.num_heads + 2 * arch.num_kv_heads, arch.head_dim).split(
            (arch.num_heads, arch.num_kv_heads, arch.num_kv_heads), dim=1)
        if arch.qk_norm:
            q = ops.rms_norm(q, layer["q_norm"], arch.rms_norm_eps)
            k = ops.rms_norm(k, layer["k_norm"], arch.rms_norm_eps)
        ops.rope_and_cache(q, k, v, batch.positions, cos_sin, k_cache, v_cache, batch.slot_blocks, batch.slot_offsets)
        group = batch.decode
        if group is not None and not batch.prefills:
            out = ops.paged_decode_attention(q, k_cache, v_cache, group.block_tables, group.context_lens, self.scale)
            return linear(out.view(-1, num_q), layer["o"])
        out = torch.empty_like(q)
        if group is not None:
            n = group.num_tokens
            out[:n] = ops.paged_decode_attention(q[:n], k_cache, v_cache, group.block_tables, group.context_lens, self.scale)
        for seg in batch.prefills:
            rows = slice(seg.row_start, seg.row_end)
            out[rows] = self._prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, seg)
        return linear(out.view(-1, num_q), layer["o"])

    def _prefill_attention(self, q, k, v, k_cache, v_cache, seg: PrefillSegment) -> torch.Tensor:
        if self._csrc_prefill:  # in place from the cache, float32 softmax
            return self.ops.paged_prefill_attention(q, k_cache, v_cache, seg.block_ids, seg.start_pos, self.scale)
        num_new = q.shape[0]
        if seg.start_pos == 0:
            # The keys as the cache holds them (rounded, under a narrower cache): a prompt's tokens
            # are the same whether its prefix came from the cache or not.
            keys, values = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
            mask, causal = None, True
        else:
            ctx = seg.start_pos + num_new
            keys = self.ops.gather_blocks(k_cache, seg.block_ids).flatten(0, 1)[:ctx].to(q.dtype)
            values = self.ops.gather_blocks(v_cache, seg.block_ids).flatten(0, 1)[:ctx].to(q.dtype)
            rows = torch.arange(num_new, device=q.device)[:, None] + seg.start_pos
            mask, causal = torch.arange(ctx, device=q.device)[None, :] <= rows, False
        # 4-d [1, heads, tokens, head_dim], as HF calls it: torch's CPU flash kernel takes only that
        # form; 3-d inputs fall to the math path, 2-4.5x slower on a prompt of 256-1024 tokens.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True,
        )
        return out[0].transpose(0, 1)


def _nbytes(w: Weight) -> int:
    if isinstance(w, PackedWeight):
        return w.packed.nbytes + w.scales.nbytes
    return w.packed.nbytes if isinstance(w, (OnednnWeight, TiledWeight)) else w.nbytes
