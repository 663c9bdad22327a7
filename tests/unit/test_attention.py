"""Prefill attention (disagg/engine/models/attention.py) against the math in float64."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.models import attention
from disagg.ops import csrc_status, load_ops

OPS = {"torch": load_ops("torch"), **({"csrc": load_ops("csrc")} if csrc_status() is None else {})}


def exact(q, keys, values, start_pos, scale):
    """softmax(q k^T * scale) v over keys [0, start_pos + i] for query i, in float64."""
    q, keys, values = q.double(), keys.double(), values.double()
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("thd,khd->htk", q, keys) * scale
    rows = torch.arange(q.shape[0])[:, None] + start_pos
    scores.masked_fill_(torch.arange(keys.shape[0])[None, :] > rows, float("-inf"))
    return torch.einsum("htk,khd->thd", torch.softmax(scores, -1), values)


def inputs(num_new, start_pos, dtype, heads=9, kv_heads=3, dim=64):
    gen = torch.Generator().manual_seed(num_new * 7 + start_pos)
    ctx = start_pos + num_new
    make = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    return make(num_new, heads, dim), make(ctx, kv_heads, dim), make(ctx, kv_heads, dim)


@pytest.mark.parametrize("kernels", sorted(OPS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.03)])
@pytest.mark.parametrize("num_new,start_pos", [(1, 0), (37, 0), (20, 45), (300, 0)])
def test_prefill_attention_is_causal_attention(kernels, dtype, tol, num_new, start_pos):
    q, keys, values = inputs(num_new, start_pos, dtype)
    got = attention.prefill_attention(OPS[kernels], q, keys, values, start_pos, 0.125)
    assert got.dtype == dtype and got.shape == (num_new, 9, 64)
    assert (got.double() - exact(q, keys, values, start_pos, 0.125)).abs().max() < tol


@pytest.mark.parametrize("kernels", sorted(OPS))
def test_query_chunks_see_the_keys_up_to_their_last_row(kernels, monkeypatch):
    q, keys, values = inputs(23, 10, torch.bfloat16)
    whole = attention.prefill_attention(OPS[kernels], q, keys, values, 10, 0.125)
    monkeypatch.setattr(attention, "QUERY_CHUNK_ROWS", 4)  # 6 chunks, the last one of 3 rows
    chunked = attention.prefill_attention(OPS[kernels], q, keys, values, 10, 0.125)
    torch.testing.assert_close(chunked, whole, atol=0.0, rtol=0.0)
