"""The KV checksum's digest (kvtransfer/checksum.py) reads each block as a TP-1 cache holds it, so
sides of different TP sizes holding the same KV digest alike: exact values over hand-built regions."""

import numpy as np
import pytest
import xxhash

from kvtransfer.base import KVLayout
from kvtransfer.checksum import KVDigest, LandedDigest, flip_byte, kv_digest, pieces

LAYERS, TOKENS, HEADS, DIM, BLOCKS = 2, 4, 4, 8, 3
ROWS = LAYERS * 2 * TOKENS


def logical_kv() -> np.ndarray:
    """[block, row, head, dim] float32: the KV as one rank holding every head has it."""
    return np.random.default_rng(0).standard_normal((BLOCKS, ROWS, HEADS, DIM), dtype=np.float32)


def layout(region: np.ndarray, tp_size: int, num_kv_heads: int = HEADS) -> KVLayout:
    local = max(num_kv_heads // tp_size, 1)
    return KVLayout(base_address=region.ctypes.data, num_blocks=BLOCKS, block_size_bytes=ROWS * local * DIM * 4,
                    block_size_tokens=TOKENS, dtype="float32", num_layers=LAYERS, num_kv_heads=num_kv_heads,
                    head_dim=DIM, tp_size=tp_size)


def split(kv: np.ndarray, tp_size: int) -> np.ndarray:
    """The TP group's region: rank r's cache (its heads' share) after rank r-1's."""
    per = HEADS // tp_size
    return np.ascontiguousarray(np.stack([kv[:, :, r * per:(r + 1) * per] for r in range(tp_size)]))


def test_every_tp_size_digests_the_same_kv_alike():
    kv = logical_kv()
    one = np.ascontiguousarray(kv)
    want = xxhash.xxh3_64(one[2].tobytes() + one[0].tobytes()).intdigest()
    assert kv_digest(layout(one, 1), [2, 0]) == want  # a TP-1 side: its blocks as they lie, in the order given
    for tp_size in (2, 4):
        region = split(kv, tp_size)
        assert kv_digest(layout(region, tp_size), [2, 0]) == want
    assert kv_digest(layout(one, 1), [0, 2]) != want


def test_blocks_digested_a_write_at_a_time_equal_them_all_at_once():
    """The push flow's prefill adds each write's blocks as it posts the write: the same value as one digest of
    them all, on a TP-1 side and a TP group; nothing added is the digest of nothing."""
    kv = logical_kv()
    one = np.ascontiguousarray(kv)
    want = xxhash.xxh3_64(one[2].tobytes() + one[0].tobytes() + one[1].tobytes()).intdigest()
    for region, tp_size in ((one, 1), (split(kv, 2), 2), (split(kv, 4), 4)):
        assert KVDigest(layout(region, tp_size)).update([2]).update([0, 1]).value() == want
        assert kv_digest(layout(region, tp_size), [2, 0, 1]) == want
    assert KVDigest(layout(one, 1)).value() == (xxhash.xxh3_64(b"").intdigest() or 1)


def test_a_flipped_byte_on_any_rank_changes_the_digest():
    kv = logical_kv()
    region = split(kv, 2)
    lay = layout(region, 2)
    before = kv_digest(lay, [1])
    kept = region[1, 1, 5, 0, 3]
    region[1, 1, 5, 0, 3] = kept + 1.0  # rank 1's copy of block 1
    assert kv_digest(lay, [1]) != before
    region[1, 1, 5, 0, 3] = kept
    assert kv_digest(lay, [1]) == before
    flip_byte(lay, 1)  # the corrupt_transfers fault: rank 0's first byte of the block
    assert kv_digest(lay, [1]) != before


def test_replicated_heads_are_read_from_their_first_rank():
    # Two KV heads over four ranks: ranks 0 and 1 hold head 0, ranks 2 and 3 head 1.
    kv = logical_kv()[:, :, :2]
    region = np.ascontiguousarray(np.stack([kv[:, :, r // 2:r // 2 + 1] for r in range(4)]))
    lay = layout(region, 4, num_kv_heads=2)
    want = xxhash.xxh3_64(np.ascontiguousarray(kv[0]).tobytes()).intdigest()
    assert kv_digest(lay, [0]) == want
    region[1, 0] = 7.0  # a replica no one reads
    region[3, 0] = 7.0
    assert kv_digest(lay, [0]) == want
    region[2, 0, 0, 0, 0] = 7.0  # head 1's first holder
    assert kv_digest(lay, [0]) != want


def test_pieces_that_land_in_any_order_digest_as_the_whole():
    """The decode digests each piece once its notification says it landed, in block order whatever
    the order of the notifications: the same value as one digest of every block."""
    one = np.ascontiguousarray(logical_kv())
    lay = layout(one, 1)
    want = kv_digest(lay, [2, 0, 1])
    landed = LandedDigest(lay, [2, 0, 1])
    landed.landed(1, 2)  # block 0 first: it waits for block 2
    assert landed.num_digested == 0
    landed.landed(0, 1)
    assert landed.num_digested == 2
    landed.landed(0, 1)  # a piece reported twice, and tags outside the blocks, are ignored
    landed.landed(2, 9)
    landed.landed(3, 4)
    assert landed.num_digested == 2
    assert landed.value() == want  # the rest (block 1, never reported) read at the end
    assert LandedDigest(lay, [2, 0, 1]).value() == want  # nothing reported: one whole digest


def test_a_byte_changed_before_its_piece_is_digested_changes_the_digest():
    one = np.ascontiguousarray(logical_kv())
    lay = layout(one, 1)
    want = kv_digest(lay, [0, 1, 2])
    landed = LandedDigest(lay, [0, 1, 2])
    landed.landed(0, 1)
    one[1, 3, 2, 1] += 1.0  # lands wrong in a piece not yet digested
    landed.landed(1, 3)
    assert landed.value() != want


def test_a_write_goes_in_pieces_of_whole_blocks_of_about_piece_bytes():
    one = np.ascontiguousarray(logical_kv())
    lay = layout(one, 1)  # 2 KiB blocks: 2 MiB (tcp's default) is 1024 of them
    assert list(pieces(5, 2056, lay, 2 << 20)) == [(5, 1029), (1029, 2053), (2053, 2056)]
    assert list(pieces(4, 4, lay, 2 << 20)) == []
    big = KVLayout(base_address=4096, num_blocks=2, block_size_bytes=3 << 20, block_size_tokens=TOKENS,
                   dtype="float32", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, tp_size=2)
    assert list(pieces(0, 3, big, 2 << 20)) == [(0, 1), (1, 2), (2, 3)]  # a block larger than a piece: one a piece
    assert list(pieces(0, 5, lay, piece_bytes=3 * lay.block_size_bytes)) == [(0, 3), (3, 5)]
    assert list(pieces(2, 7000, lay, piece_bytes=0)) == [(2, 7000)]  # 0: the write whole


def test_piece_size_defaults_by_backend_and_refuses_a_negative_one():
    from disagg.config import ConfigError
    from disagg.pd_config import DisaggConfig

    assert DisaggConfig(transfer_backend="tcp").checksum_piece_bytes == 2 << 20
    assert DisaggConfig(transfer_backend="nixl").checksum_piece_bytes == 0  # whole writes
    assert DisaggConfig(transfer_backend="nixl", kv_checksum_piece_bytes=4096).checksum_piece_bytes == 4096
    with pytest.raises(ConfigError, match=r"^kv_checksum_piece_bytes must be >= 0 \(0: whole writes\), got -1$"):
        DisaggConfig(kv_checksum_piece_bytes=-1)


def test_a_fault_flips_the_first_block_just_before_it_is_read():
    """corrupt_transfers: the flip runs once, when block 0 is about to be digested (it has landed then),
    not when the digest is begun, so a later write of block 0 cannot undo it."""
    one = np.ascontiguousarray(logical_kv())
    lay = layout(one, 1)
    want = kv_digest(lay, [0, 1, 2])
    flips = []
    landed = LandedDigest(lay, [0, 1, 2], before_first=lambda: (flips.append(1), flip_byte(lay, 0)))
    landed.landed(1, 3)  # block 0 not reported yet: nothing read, nothing flipped
    assert flips == []
    landed.landed(0, 1)
    assert flips == [1]
    assert landed.value() != want and flips == [1]
    flip_byte(lay, 0)  # back as it was
    assert kv_digest(lay, [0, 1, 2]) == want
    late = LandedDigest(lay, [0, 1, 2], before_first=lambda: flips.append(2))
    assert late.value() == want and flips == [1, 2]  # read at the end: flipped (here: noted) then
