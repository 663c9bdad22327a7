"""Which heads each TP rank holds, the layout check across TP sizes, and the head-slice copies."""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer.base import InvalidLayout, KVLayout, LayoutMismatch
from kvtransfer.handshake import check_compatible
from kvtransfer.heads import head_slice_copies, head_sources, rank_heads, same_split, split_problem
from kvtransfer.staging import assemble, disperse, read_staging, source_ranks, write_staging


def layout(tp: int, heads: int = 2, num_blocks: int = 3) -> KVLayout:
    """1 layer, 2-token pages, head_dim 1, one byte per element: a block of one rank is 4 rows."""
    return KVLayout.for_cache(0x1000, num_blocks, num_layers=1, block_size_tokens=2, num_kv_heads=heads, head_dim=1,
                              dtype="uint8", tp_size=tp)


def test_rank_heads_split_and_replicate():
    assert [rank_heads(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [rank_heads(4, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [rank_heads(3, 1, 0)] == [(0, 3)]
    assert split_problem(3, 2) == "num_kv_heads 3 neither divides nor is divided by tp_size 2"
    assert split_problem(3, 6) is None and split_problem(4, 2) is None


def test_layout_sizes_per_rank_and_region():
    one, two = layout(1), layout(2)
    assert (one.block_size_bytes, one.size_bytes) == (8, 24)
    assert (two.block_size_bytes, two.size_bytes) == (4, 24)
    assert two.block_address(2, rank=1) == 0x1000 + (3 + 2) * 4
    with pytest.raises(InvalidLayout, match="num_kv_heads 3 neither divides nor is divided by tp_size 2"):
        layout(2, heads=3)
    with pytest.raises(InvalidLayout, match="a layout with tp_size > 1 names num_kv_heads and head_dim"):
        KVLayout(0x1000, 3, 4, 2, "uint8", tp_size=2)


def test_compatible_across_tp_sizes_and_what_is_refused():
    check_compatible(layout(1), "p", layout(2))  # same model shape: different TP sizes exchange slices
    check_compatible(layout(2), "p", layout(2))
    assert not same_split(layout(1), layout(2)) and same_split(layout(2), layout(2))
    with pytest.raises(LayoutMismatch, match="KV layout mismatch with peer 'p': num_kv_heads is 4 there and 2 here"):
        check_compatible(layout(1), "p", layout(2, heads=4))
    with pytest.raises(LayoutMismatch, match="block_size_bytes is 16 there and 8 here"):
        check_compatible(layout(1), "p", layout(1, heads=4))
    unnamed = KVLayout(0x1000, 3, 8, 2, "uint8")
    with pytest.raises(LayoutMismatch, match="tp_size is 1 there and 2 here"):
        check_compatible(layout(2), "p", unnamed)


def test_head_sources_read_a_replicated_head_from_one_rank():
    assert head_sources(4, 1, 2) == [[(0, 2, 0)], [(2, 4, 0)]]
    assert head_sources(4, 2, 1) == [[(0, 2, 0), (2, 4, 1)]]
    assert head_sources(2, 4, 1) == [[(0, 1, 0), (1, 2, 2)]]  # ranks 1 and 3 hold copies: never read
    assert head_sources(2, 1, 4) == [[(0, 1, 0)], [(0, 1, 0)], [(1, 2, 0)], [(1, 2, 0)]]


def test_copies_tp1_to_tp2_exact_offsets():
    copies = head_slice_copies(layout(1), layout(2), [1], [0])
    # source block 1 at 8, rows of 2 bytes (heads 0, 1); destination rank 0 block 0 at 0, rank 1 at (3 + 0) * 4
    assert copies.src.tolist() == [8, 10, 12, 14, 9, 11, 13, 15]
    assert copies.dst.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert copies.size.tolist() == [1] * 8
    assert copies.num_bytes == 8  # one copy of the block


def test_copies_tp2_to_tp1_exact_offsets():
    copies = head_slice_copies(layout(2), layout(1), [2], [1])
    assert copies.src.tolist() == [8, 9, 10, 11, 20, 21, 22, 23]
    assert copies.dst.tolist() == [8, 10, 12, 14, 9, 11, 13, 15]
    assert copies.num_bytes == 8


def test_copies_merge_when_whole_rows_line_up():
    # 2 heads over 4 ranks (each head twice) to 2 ranks (one head each): rank 0 reads all of source
    # rank 0, rank 1 all of source rank 2, whole blocks, adjacent blocks merged
    copies = head_slice_copies(layout(4), layout(2), [0, 1], [1, 2])
    src_block, dst_block = layout(4).block_size_bytes, layout(2).block_size_bytes
    assert copies.src.tolist() == [0, 2 * 3 * src_block]
    assert copies.dst.tolist() == [1 * dst_block, (3 + 1) * dst_block]
    assert copies.size.tolist() == [2 * dst_block, 2 * dst_block]


def test_copies_cover_every_destination_byte_once():
    for heads, a, b in [(4, 1, 2), (4, 2, 4), (4, 4, 1), (2, 1, 4), (2, 4, 2)]:
        src, dst = layout(a, heads, num_blocks=5), layout(b, heads, num_blocks=4)
        copies = head_slice_copies(src, dst, [4, 0], [1, 3])
        written = np.concatenate([np.arange(d, d + n) for d, n in zip(copies.dst, copies.size)])
        assert written.size == np.unique(written).size == 2 * b * dst.block_size_bytes, (heads, a, b)


def test_staging_moves_whole_blocks_of_the_ranks_needed():
    # a WRITE stages every destination rank's blocks, rank by rank
    staged = write_staging(layout(2), [2, 0])
    assert (staged.size_bytes, staged.remote_offsets.tolist(), staged.block_bytes) == (16, [8, 0, 20, 12], 4)
    # a READ from 4 ranks holding 2 heads twice reads ranks 0 and 2 only: one copy
    assert source_ranks(layout(4), layout(1)) == [0, 2]
    staged = read_staging(layout(1), layout(4), [1])
    assert (staged.size_bytes, staged.remote_offsets.tolist()) == (8, [4, 28])  # block 1 of ranks 0 and 2, 4 bytes each
    assert read_staging(layout(1), layout(4), [1, 2]).remote_offsets.tolist() == [4, 8, 28, 32]


def test_assemble_and_disperse_put_each_head_where_its_rank_holds_it():
    one, two = layout(1, num_blocks=2), layout(2, num_blocks=2)
    region = np.arange(one.size_bytes, dtype=np.uint8)  # block b, row r, head h at b * 8 + r * 2 + h
    staging = np.zeros(write_staging(two, [1]).size_bytes, dtype=np.uint8)
    assemble(staging, region, one, two, [0])
    assert staging.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]  # rank 0's block: head 0 of each row; then rank 1's
    back = np.zeros(one.size_bytes, dtype=np.uint8)
    disperse(staging, back, one, two, [1])  # read side: the staged source blocks are two's; we are one
    assert back.tolist() == [0] * 8 + list(range(8))
