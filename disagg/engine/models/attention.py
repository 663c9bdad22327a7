"""Prefill attention: a chunk of one request's new tokens against all its keys so far.

Two ways, picked by dtype (measured on SmolLM2's 9 query / 3 KV heads of 64, 2 threads,
docs/engine.md):

- float32: torch's SDPA with 4-d inputs, its CPU flash kernel (the call HF makes, so greedy outputs
  stay equal to HF's).
- bfloat16: per KV head, two batched matmuls around the ops' `causal_softmax`, the math of HF's
  eager attention (scores rounded to bfloat16, softmax in float32). torch's flash kernel reaches only
  ~70 GFLOP/s on these shapes in bfloat16: at 250 tokens it takes 1.05 ms a layer, the matmuls and
  the softmax 0.3 ms. Queries go in chunks of `QUERY_CHUNK_ROWS`, each against the keys up to its
  last row, so a long prompt skips most of the masked half.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QUERY_CHUNK_ROWS = 256


def prefill_attention(ops, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int,
                      scale: float) -> torch.Tensor:
    """q [T, heads, head_dim] at positions [start_pos, start_pos + T); keys and values
    [start_pos + T, kv_heads, head_dim]. Causal: query i sees keys [0, start_pos + i]. → [T, heads, head_dim]."""
    if q.dtype == torch.float32:
        return _flash(q, keys, values, start_pos, scale)
    out = torch.empty_like(q)
    for first in range(0, q.shape[0], QUERY_CHUNK_ROWS):
        rows = slice(first, min(first + QUERY_CHUNK_ROWS, q.shape[0]))
        ctx = start_pos + rows.stop
        out[rows] = _grouped_matmuls(ops, q[rows], keys[:ctx], values[:ctx], start_pos + first, scale)
    return out


def _grouped_matmuls(ops, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int,
                     scale: float) -> torch.Tensor:
    n, num_heads, dim = q.shape
    num_kv, ctx = keys.shape[1], keys.shape[0]
    group = num_heads // num_kv
    # [kv_heads, group * n, dim]: the query heads that share a KV head are one matmul's rows.
    grouped = q.reshape(n, num_kv, group, dim).permute(1, 2, 0, 3).reshape(num_kv, group * n, dim)
    scores = torch.bmm(grouped, keys.permute(1, 2, 0))  # [kv_heads, group * n, ctx]
    probs = ops.causal_softmax(scores.view(num_kv * group, n, ctx), first_pos, scale)
    out = torch.bmm(probs.view(num_kv, group * n, ctx), values.transpose(0, 1))  # [kv_heads, group * n, dim]
    return out.view(num_kv, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)


def _flash(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int, scale: float) -> torch.Tensor:
    mask = None
    if start_pos:
        rows = torch.arange(q.shape[0], device=q.device)[:, None] + start_pos
        mask = torch.arange(keys.shape[0], device=q.device)[None, :] <= rows
    # 4-d [1, heads, tokens, head_dim], as HF calls it: torch's CPU flash kernel takes only that
    # form; 3-d inputs fall to the math path, 2-4.5x slower on a prompt of 256-1024 tokens.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)
