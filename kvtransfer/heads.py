"""Tensor parallelism in the KV layout: which KV heads each rank's cache holds, whether two caches can
exchange blocks, and the byte copies that move blocks between caches of different TP sizes.

A region registered by a TP group holds one cache per rank, back to back: rank r's block b starts at
`(r * num_blocks + b) * block_size_bytes`, and inside a block the rows run (layer, K or V, token),
each row the rank's heads x head_dim. Ranks split the heads as Megatron does: equal contiguous
shares, or, when the ranks outnumber the heads, each head replicated on `tp_size / num_kv_heads`
neighbouring ranks (vLLM's rule). Pure arithmetic: numbers in, numpy offsets out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np


class HeadLayout(Protocol):
    """The fields of a KV layout this module reads (KVLayout and the control plane's KVLayoutMsg)."""

    num_blocks: int
    block_size_tokens: int
    block_size_bytes: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int


class Copies(NamedTuple):
    """Byte copies, offsets relative to each region's start: source, destination, length."""

    src: np.ndarray
    dst: np.ndarray
    size: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.size.sum())


def split_problem(num_kv_heads: int, tp_size: int) -> str | None:
    """Why `num_kv_heads` cannot be split over `tp_size` ranks, or None."""
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        return f"num_kv_heads {num_kv_heads} neither divides nor is divided by tp_size {tp_size}"
    return None


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The KV heads [start, end) that `rank` of `tp_size` holds."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return rank * per, (rank + 1) * per
    head = rank // (tp_size // num_kv_heads)
    return head, head + 1


class Mismatch(NamedTuple):
    """The first field on which two caches differ where they must not: its name, ours, theirs."""

    field: str
    ours: object
    theirs: object


def layout_mismatch(ours: HeadLayout, theirs: HeadLayout) -> Mismatch | None:
    """Why two caches cannot exchange blocks, or None.

    Equal TP sizes need equal blocks. Different ones need the same model shape (layers, KV heads,
    head_dim), so that every head one side needs is somewhere on the other; a layout that does not
    name its heads (0) cannot change TP size."""
    fields = ["block_size_tokens", "dtype", "num_layers"]
    if ours.tp_size == theirs.tp_size:
        fields.append("block_size_bytes")
    elif not (ours.num_kv_heads and ours.head_dim and theirs.num_kv_heads and theirs.head_dim):
        fields.append("tp_size")
    else:
        fields += ["num_kv_heads", "head_dim"]
    for name in fields:
        mine, other = getattr(ours, name), getattr(theirs, name)
        if mine != other:
            return Mismatch(name, mine, other)
    return None


def same_split(a: HeadLayout, b: HeadLayout) -> bool:
    """True when rank r of one side holds exactly the heads of rank r of the other: blocks move
    whole, rank to rank."""
    return a.tp_size == b.tp_size and a.block_size_bytes == b.block_size_bytes


def head_sources(src_heads: int, src_tp: int, dst_tp: int) -> list[list[tuple[int, int, int]]]:
    """Per destination rank, its heads as (first head, end, source rank) groups: each head from the
    first source rank holding it, so that a replicated head is read from one rank only."""
    owner = {}
    for rank in range(src_tp):
        start, end = rank_heads(src_heads, src_tp, rank)
        for head in range(start, end):
            owner.setdefault(head, rank)
    plan = []
    for rank in range(dst_tp):
        groups: list[tuple[int, int, int]] = []
        for head in range(*rank_heads(src_heads, dst_tp, rank)):
            if groups and groups[-1][1] == head and groups[-1][2] == owner[head]:
                groups[-1] = (groups[-1][0], head + 1, owner[head])
            else:
                groups.append((head, head + 1, owner[head]))
        plan.append(groups)
    return plan


def head_slice_copies(src: HeadLayout, dst: HeadLayout, src_ids: Sequence[int], dst_ids: Sequence[int]) -> Copies:
    """The copies that fill destination blocks `dst_ids` (on every destination rank, with the heads
    it holds) from source blocks `src_ids`: one per (block, row, group of heads), merged where they
    are contiguous on both sides. Each destination byte is written once."""
    heads, head_bytes = src.num_kv_heads, head_row_bytes(src)
    rows = src.num_layers * 2 * src.block_size_tokens
    row = np.arange(rows, dtype=np.int64)[None, :]
    s_ids, d_ids = np.asarray(src_ids, dtype=np.int64)[:, None], np.asarray(dst_ids, dtype=np.int64)[:, None]
    s_row, d_row = src.block_size_bytes // rows, dst.block_size_bytes // rows
    parts_src, parts_dst, parts_size = [], [], []
    for dst_rank, groups in enumerate(head_sources(heads, src.tp_size, dst.tp_size)):
        d_first = rank_heads(heads, dst.tp_size, dst_rank)[0]
        for start, end, src_rank in groups:
            s_first = rank_heads(heads, src.tp_size, src_rank)[0]
            s = (src_rank * src.num_blocks + s_ids) * src.block_size_bytes + row * s_row + (start - s_first) * head_bytes
            d = (dst_rank * dst.num_blocks + d_ids) * dst.block_size_bytes + row * d_row + (start - d_first) * head_bytes
            parts_src.append(s.ravel())
            parts_dst.append(d.ravel())
            parts_size.append(np.full(s.size, (end - start) * head_bytes, dtype=np.int64))
    return merge(Copies(np.concatenate(parts_src), np.concatenate(parts_dst), np.concatenate(parts_size)))


def head_row_bytes(layout: HeadLayout) -> int:
    """Bytes of one KV head in one row (layer, K or V, token) of a block."""
    return layout.head_dim * (layout.block_size_bytes // _block_elems(layout))


def _block_elems(layout: HeadLayout) -> int:
    """Elements in one block of one rank (the element size is block bytes over this)."""
    local = rank_heads(layout.num_kv_heads, layout.tp_size, 0)
    return layout.num_layers * 2 * layout.block_size_tokens * (local[1] - local[0]) * layout.head_dim


def merge(copies: Copies) -> Copies:
    """Each copy that continues the one before it on both sides joined to it."""
    if copies.size.size == 0:
        return copies
    follows = (copies.src[1:] == copies.src[:-1] + copies.size[:-1]) & (copies.dst[1:] == copies.dst[:-1] + copies.size[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return Copies(copies.src[starts], copies.dst[starts], np.add.reduceat(copies.size, starts))
