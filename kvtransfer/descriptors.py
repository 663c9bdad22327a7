"""Block ids -> byte ranges: validation, coalescing of adjacent blocks, descriptors, host views.

Pure address arithmetic over a KVLayout; no transport here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

from kvtransfer.base import InvalidBlockIds, KVLayout


class BlockRange(NamedTuple):
    """`num_blocks` consecutive block ids starting at `start`."""

    start: int
    num_blocks: int


class BlockRun(NamedTuple):
    """Blocks contiguous on both sides: local[start:start+n] <-> remote[start:start+n]."""

    local_start: int
    remote_start: int
    num_blocks: int


class Descriptor(NamedTuple):
    """One byte range of a registered region, NIXL's (address, length, device id)."""

    address: int
    size_bytes: int
    device_id: int


class Slices(NamedTuple):
    """Byte copies between two caches whose TP sizes differ (kvtransfer/heads.py), offsets from
    each region's start: ours, the peer's, and each copy's length."""

    local: np.ndarray
    remote: np.ndarray
    size: np.ndarray


SMALL_RANGE_BYTES = 64 * 1024
STAGING_BYTES = 16 * 2**20  # the most one staged copy holds


class Segments:
    """Many byte ranges of one region as two int64 arrays, offsets and sizes: head slices, tens of
    thousands per transfer, moved with one vectorized copy instead of a syscall or a tuple each."""

    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets: np.ndarray, sizes: np.ndarray) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def small(self) -> bool:
        """Ranges of under 64 KiB on average: one staged, vectorized copy beats a syscall each."""
        return len(self) > 0 and self.total_bytes < len(self) * SMALL_RANGE_BYTES

    def pairs(self) -> list[Segment]:
        return [Segment(o, n) for o, n in zip(self.offsets.tolist(), self.sizes.tolist())]

    def chunks(self, max_bytes: int | None = None) -> Iterator[Segments]:
        """The ranges in order, in runs of at most `max_bytes` (default STAGING_BYTES; one range, if
        larger): a staging buffer stays bounded whatever a transfer's size."""
        max_bytes = max_bytes or STAGING_BYTES
        ends = np.cumsum(self.sizes)
        start, done = 0, 0
        while start < len(self):
            stop = max(int(np.searchsorted(ends, done + max_bytes, side="right")), start + 1)
            yield Segments(self.offsets[start:stop], self.sizes[start:stop])
            start, done = stop, int(ends[stop - 1])

    def first_out_of_bounds(self, size_bytes: int) -> Segment | None:
        """The first range not inside a region of `size_bytes` (or empty), or None."""
        bad = np.flatnonzero((self.offsets < 0) | (self.sizes <= 0) | (self.offsets + self.sizes > size_bytes))
        return None if bad.size == 0 else Segment(int(self.offsets[bad[0]]), int(self.sizes[bad[0]]))

    def gather(self, region: memoryview) -> memoryview:
        """The ranges' bytes, in order, as one new buffer."""
        rows, index = self._rows(region)
        return memoryview(rows[index].reshape(-1))

    def scatter(self, region: memoryview, data: memoryview | bytearray) -> None:
        """Write `data` (total_bytes, in order) into the ranges."""
        rows, index = self._rows(region)
        rows[index] = np.frombuffer(data, dtype=np.uint8).reshape(len(index), -1)

    def _rows(self, region: memoryview) -> tuple[np.ndarray, np.ndarray]:
        """The region as rows of the largest unit dividing every offset and size, and the rows the
        ranges cover, in order."""
        unit = int(np.gcd.reduce(np.concatenate([self.offsets, self.sizes])))
        counts = self.sizes // unit
        starts = np.cumsum(counts) - counts
        index = np.arange(int(counts.sum())) + np.repeat(self.offsets // unit - starts, counts)
        flat = np.frombuffer(region, dtype=np.uint8)
        return flat[: len(flat) // unit * unit].reshape(-1, unit), index


class Segment(NamedTuple):
    """A byte range relative to the start of a registered region."""

    offset_bytes: int
    size_bytes: int


def check_block_ids(block_ids: Sequence[int], num_blocks: int, side: str) -> list[int]:
    """Validated copy of `block_ids`: non-empty, every id in [0, num_blocks), no repeats."""
    ids = [int(block_id) for block_id in block_ids]
    if not ids:
        raise InvalidBlockIds(f"{side} block ids are empty; a transfer needs at least one block")
    seen: set[int] = set()
    for block_id in ids:
        if not 0 <= block_id < num_blocks:
            raise InvalidBlockIds(f"{side} block id {block_id} is out of range [0, {num_blocks})")
        if block_id in seen:
            raise InvalidBlockIds(f"{side} block id {block_id} appears twice")
        seen.add(block_id)
    return ids


def check_block_pairs(
    local_block_ids: Sequence[int], remote_block_ids: Sequence[int], local_num_blocks: int, remote_num_blocks: int,
) -> tuple[list[int], list[int]]:
    """Validated (local, remote) id lists of equal length."""
    local = check_block_ids(local_block_ids, local_num_blocks, "local")
    remote = check_block_ids(remote_block_ids, remote_num_blocks, "remote")
    if len(local) != len(remote):
        raise InvalidBlockIds(f"{len(local)} local block ids but {len(remote)} remote block ids")
    return local, remote


def coalesce(block_ids: Sequence[int]) -> list[BlockRange]:
    """Merge ascending neighbours: [3, 4, 5, 9, 2] -> [(3, 3), (9, 1), (2, 1)]. Order is kept."""
    ranges: list[BlockRange] = []
    for block_id in block_ids:
        if ranges and ranges[-1].start + ranges[-1].num_blocks == block_id:
            ranges[-1] = BlockRange(ranges[-1].start, ranges[-1].num_blocks + 1)
        else:
            ranges.append(BlockRange(block_id, 1))
    return ranges


def pair_runs(local_block_ids: Sequence[int], remote_block_ids: Sequence[int]) -> list[BlockRun]:
    """Merge pairs whose ids are consecutive on BOTH sides into one run (one descriptor each side)."""
    runs: list[BlockRun] = []
    for local_id, remote_id in zip(local_block_ids, remote_block_ids):
        if runs:
            last = runs[-1]
            if last.local_start + last.num_blocks == local_id and last.remote_start + last.num_blocks == remote_id:
                runs[-1] = BlockRun(last.local_start, last.remote_start, last.num_blocks + 1)
                continue
        runs.append(BlockRun(local_id, remote_id, 1))
    return runs


def rank_runs(runs: Sequence[BlockRun], tp_size: int, local_num_blocks: int, remote_num_blocks: int) -> list[BlockRun]:
    """The runs on every TP rank, rank to rank, as ids over the region's `tp_size * num_blocks` blocks."""
    return [BlockRun(rank * local_num_blocks + r.local_start, rank * remote_num_blocks + r.remote_start, r.num_blocks)
            for rank in range(tp_size) for r in runs]


def describe(layout: KVLayout, block_ids: Sequence[int]) -> list[Descriptor]:
    """Descriptors of `block_ids` in `layout` on every TP rank, adjacent ids coalesced into one descriptor."""
    ids = check_block_ids(block_ids, layout.num_blocks, "local")
    return [
        Descriptor(layout.block_address(r.start, rank), r.num_blocks * layout.block_size_bytes, layout.device_id)
        for rank in range(layout.tp_size) for r in coalesce(ids)
    ]


def run_segments(layout_block_bytes: int, runs: Sequence[BlockRun]) -> tuple[list[Segment], list[Segment]]:
    """(local segments, remote segments) of the runs, for backends that address by offset."""
    local = [Segment(r.local_start * layout_block_bytes, r.num_blocks * layout_block_bytes) for r in runs]
    remote = [Segment(r.remote_start * layout_block_bytes, r.num_blocks * layout_block_bytes) for r in runs]
    return local, remote


def block_table(layout: KVLayout) -> list[tuple[int, int, int]]:
    """One (address, size_bytes, device_id) per block of every rank, in region order: what NIXL preps once."""
    return [(layout.base_address + i * layout.block_size_bytes, layout.block_size_bytes, layout.device_id)
            for i in range(layout.tp_size * layout.num_blocks)]


def host_view(layout: KVLayout) -> memoryview:
    """A writable byte view over a host (cpu) region. The caller keeps the memory alive."""
    if layout.is_cuda:
        raise ValueError(f"host_view needs host memory, the layout is on {layout.device}")
    buffer = (ctypes.c_ubyte * layout.size_bytes).from_address(layout.base_address)
    return memoryview(buffer).cast("B")


def segment_in_bounds(segment: Segment, size_bytes: int) -> bool:
    """True when the segment lies inside a region of `size_bytes`."""
    return segment.size_bytes > 0 and 0 <= segment.offset_bytes and segment.offset_bytes + segment.size_bytes <= size_bytes
