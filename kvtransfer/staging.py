"""Whole blocks through a staging buffer, for a one-sided transport (NIXL) between caches of different
TP sizes. Head slices are thousands of small ranges a block (kvtransfer/heads.py) and such a
transport pays per range, so the side that posts the transfer copies locally and moves whole blocks:

- a WRITE assembles each destination block as the destination rank lays it out (its heads, from our
  ranks holding them) in the staging buffer, then writes whole destination blocks;
- a READ reads whole blocks of the source ranks it needs (each head from its first holder) into the
  staging buffer, then hands each local rank its heads from there.

One copy of the needed KV crosses, as whole blocks. The local copies are numpy slice assignments over
block views ([ranks, blocks, rows, heads, bytes per head]), one per (rank, run of heads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from kvtransfer.heads import HeadLayout, head_sources, rank_heads


class Staging(NamedTuple):
    """A staged transfer: the buffer's size, and the whole blocks that cross, in buffer order, as
    offsets in the peer's region (block i of the buffer is at `i * block_bytes`)."""

    size_bytes: int
    remote_offsets: np.ndarray
    block_bytes: int


class Staged(NamedTuple):
    """One staged transfer, ready to move: its whole blocks (`plan`), the buffer, and for a READ what
    hands our ranks their heads once the blocks landed in it (None for a WRITE: it is assembled)."""

    plan: Staging
    buffer: np.ndarray
    finish: Callable[[], None] | None


def stage(write: bool, region: np.ndarray, local: HeadLayout, remote: HeadLayout,
          block_ids: tuple[Sequence[int], Sequence[int]]) -> Staged:
    """The staging of a WRITE (the destination's blocks assembled from `region`, our cache as uint8)
    or a READ (a buffer for the source's blocks, and the step that disperses them into `region`)."""
    local_ids, remote_ids = block_ids
    plan = write_staging(remote, remote_ids) if write else read_staging(local, remote, remote_ids)
    buffer = np.empty(plan.size_bytes, dtype=np.uint8)
    if write:
        assemble(buffer, region, local, remote, local_ids)
        return Staged(plan, buffer, None)
    return Staged(plan, buffer, lambda: disperse(buffer, region, local, remote, local_ids))


def write_staging(remote: HeadLayout, remote_ids: Sequence[int]) -> Staging:
    """The destination's blocks `remote_ids` on every one of its ranks, rank by rank."""
    return _staging(remote, remote_ids, range(remote.tp_size))


def read_staging(local: HeadLayout, remote: HeadLayout, remote_ids: Sequence[int]) -> Staging:
    """The source's blocks `remote_ids` on the ranks our heads come from, rank by rank."""
    return _staging(remote, remote_ids, source_ranks(remote, local))


def source_ranks(src: HeadLayout, dst: HeadLayout) -> list[int]:
    """The source ranks any destination head is read from (each head from its first holder)."""
    return sorted({rank for groups in head_sources(src.num_kv_heads, src.tp_size, dst.tp_size) for *_, rank in groups})


def assemble(staging: np.ndarray, region: np.ndarray, local: HeadLayout, remote: HeadLayout,
             local_ids: Sequence[int]) -> None:
    """WRITE: fill the buffer with the destination blocks (remote's layout) from our blocks `local_ids`."""
    blocks = _blocks(staging, remote, remote.tp_size, len(local_ids))
    ours, ids = _blocks(region, local, local.tp_size, local.num_blocks), np.asarray(local_ids, dtype=np.int64)
    for dst_rank, dst_heads, src_rank, src_heads in _moves(local, remote):
        blocks[dst_rank, :, :, dst_heads] = ours[src_rank, ids, :, src_heads]


def disperse(staging: np.ndarray, region: np.ndarray, local: HeadLayout, remote: HeadLayout,
             local_ids: Sequence[int]) -> None:
    """READ: hand our blocks `local_ids`, on every local rank, their heads from the source blocks in the buffer."""
    position = {rank: i for i, rank in enumerate(source_ranks(remote, local))}
    blocks = _blocks(staging, remote, len(position), len(local_ids))
    ours, ids = _blocks(region, local, local.tp_size, local.num_blocks), np.asarray(local_ids, dtype=np.int64)
    for dst_rank, dst_heads, src_rank, src_heads in _moves(remote, local):
        ours[dst_rank, ids, :, dst_heads] = blocks[position[src_rank], :, :, src_heads]


def _moves(src: HeadLayout, dst: HeadLayout) -> Iterator[tuple[int, slice, int, slice]]:
    """(destination rank, the slice of its heads, source rank, the slice of its heads) for each run of
    heads, each head from the first source rank holding it."""
    for dst_rank, groups in enumerate(head_sources(src.num_kv_heads, src.tp_size, dst.tp_size)):
        d_first = rank_heads(dst.num_kv_heads, dst.tp_size, dst_rank)[0]
        for start, end, src_rank in groups:
            s_first = rank_heads(src.num_kv_heads, src.tp_size, src_rank)[0]
            yield dst_rank, slice(start - d_first, end - d_first), src_rank, slice(start - s_first, end - s_first)


def _staging(remote: HeadLayout, remote_ids: Sequence[int], ranks: Sequence[int]) -> Staging:
    ids = np.asarray(remote_ids, dtype=np.int64)
    ranks_arr = np.asarray(list(ranks), dtype=np.int64)
    offsets = ((ranks_arr[:, None] * remote.num_blocks + ids[None, :]) * remote.block_size_bytes).ravel()
    return Staging(offsets.size * remote.block_size_bytes, offsets, remote.block_size_bytes)


def _blocks(buffer: np.ndarray, layout: HeadLayout, ranks: int, num_blocks: int) -> np.ndarray:
    """A uint8 buffer of `ranks` x `num_blocks` blocks of `layout` as [ranks, blocks, rows, heads, bytes per head]."""
    start, end = rank_heads(layout.num_kv_heads, layout.tp_size, 0)
    rows = layout.num_layers * 2 * layout.block_size_tokens
    return buffer[: ranks * num_blocks * layout.block_size_bytes].reshape(
        ranks, num_blocks, rows, end - start, layout.block_size_bytes // (rows * (end - start)))
