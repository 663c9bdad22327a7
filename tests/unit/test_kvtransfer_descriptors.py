"""Block ids -> byte ranges: validation text, coalescing, descriptors, segments."""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer.base import InvalidBlockIds, KVLayout
from kvtransfer.descriptors import (
    SMALL_RANGE_BYTES, BlockRange, BlockRun, Descriptor, Segment, Segments, block_table, check_block_ids,
    check_block_pairs, coalesce, describe, host_view, pair_runs, run_segments, segment_in_bounds,
)

LAYOUT = KVLayout(base_address=0x10000, num_blocks=8, block_size_bytes=256, block_size_tokens=16, dtype="bfloat16")


def test_coalesce_merges_ascending_neighbours_and_keeps_order():
    assert coalesce([3, 4, 5, 9, 2]) == [BlockRange(3, 3), BlockRange(9, 1), BlockRange(2, 1)]
    assert coalesce([5, 4]) == [BlockRange(5, 1), BlockRange(4, 1)]
    assert coalesce([]) == []


def test_pair_runs_merge_only_when_contiguous_on_both_sides():
    assert pair_runs([1, 2, 3, 7], [10, 11, 12, 13]) == [BlockRun(1, 10, 3), BlockRun(7, 13, 1)]
    assert pair_runs([1, 2], [5, 4]) == [BlockRun(1, 5, 1), BlockRun(2, 4, 1)]
    assert pair_runs([0, 1, 2, 3], [4, 5, 6, 7]) == [BlockRun(0, 4, 4)]


def test_describe_returns_coalesced_descriptors():
    assert describe(LAYOUT, [1, 2, 6]) == [Descriptor(0x10100, 512, 0), Descriptor(0x10600, 256, 0)]
    cuda = KVLayout(0x10000, 8, 256, 16, "bfloat16", device="cuda:3")
    assert describe(cuda, [0]) == [Descriptor(0x10000, 256, 3)]


def test_run_segments_are_offsets_into_each_region():
    local, remote = run_segments(256, [BlockRun(1, 4, 2), BlockRun(7, 0, 1)])
    assert local == [Segment(256, 512), Segment(1792, 256)]
    assert remote == [Segment(1024, 512), Segment(0, 256)]


@pytest.mark.parametrize(("ids", "message"), [
    ([], "local block ids are empty; a transfer needs at least one block"),
    ([8], "local block id 8 is out of range [0, 8)"),
    ([-1], "local block id -1 is out of range [0, 8)"),
    ([2, 3, 2], "local block id 2 appears twice"),
])
def test_bad_block_ids_are_refused_with_exact_text(ids, message):
    with pytest.raises(InvalidBlockIds) as excinfo:
        check_block_ids(ids, 8, "local")
    assert str(excinfo.value) == message


def test_pairs_must_have_equal_lengths():
    with pytest.raises(InvalidBlockIds, match="^2 local block ids but 1 remote block ids$"):
        check_block_pairs([0, 1], [5], 8, 8)
    assert check_block_pairs(range(2), np.array([4, 5]), 8, 8) == ([0, 1], [4, 5])


def test_block_table_has_one_row_per_block():
    assert block_table(KVLayout(0x1000, 3, 16, 16, "float32", device="cuda:1")) == [
        (0x1000, 16, 1), (0x1010, 16, 1), (0x1020, 16, 1),
    ]


def test_segment_bounds():
    assert segment_in_bounds(Segment(0, 2048), 2048)
    assert not segment_in_bounds(Segment(1, 2048), 2048)
    assert not segment_in_bounds(Segment(0, 0), 2048)


def test_host_view_aliases_the_callers_memory():
    memory = np.zeros(4 * 64, dtype=np.uint8)
    view = host_view(KVLayout(memory.ctypes.data, 4, 64, 16, "uint8"))
    view[64:66] = b"\x07\x09"
    assert memory[64:67].tolist() == [7, 9, 0]
    with pytest.raises(ValueError, match="needs host memory"):
        host_view(KVLayout(memory.ctypes.data, 4, 64, 16, "uint8", device="cuda:0"))


def test_segments_gather_and_scatter_exact_bytes():
    region = memoryview(bytearray(range(64)))
    segments = Segments(np.array([8, 2, 40]), np.array([4, 2, 6]))
    assert (len(segments), segments.total_bytes, segments.small) == (3, 12, True)
    assert bytes(segments.gather(region)) == bytes([8, 9, 10, 11, 2, 3, 40, 41, 42, 43, 44, 45])
    segments.scatter(region, bytearray(b"ABCDEFGHIJKL"))
    assert bytes(region[0:12]) == bytes([0, 1]) + b"EF" + bytes([4, 5, 6, 7]) + b"ABCD"
    assert bytes(region[40:46]) == b"GHIJKL" and region[46] == 46
    assert segments.pairs() == [Segment(8, 4), Segment(2, 2), Segment(40, 6)]
    assert segments.first_out_of_bounds(64) is None
    assert Segments(np.array([0, 60]), np.array([4, 8])).first_out_of_bounds(64) == Segment(60, 8)
    assert Segments(np.array([0, 8]), np.array([4, 0])).first_out_of_bounds(64) == Segment(8, 0)
    assert not Segments(np.array([0]), np.array([SMALL_RANGE_BYTES])).small
    parts = list(Segments(np.array([0, 10, 20, 30, 40]), np.array([4, 4, 9, 4, 4])).chunks(8))
    assert [(p.offsets.tolist(), p.sizes.tolist()) for p in parts] == [
        ([0, 10], [4, 4]), ([20], [9]), ([30, 40], [4, 4])]  # a range larger than the bound is a run alone
