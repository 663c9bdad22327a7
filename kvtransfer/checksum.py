"""The KV checksum (`--kv-checksum`): one 64-bit xxh3 digest over the blocks a room moves, the sender's
over what it wrote, the receiver's over what landed. Equal digests: every byte arrived as sent.

Block ids in the order given; within a block, each TP rank's copy in rank order (a TP group's region
holds its ranks' caches back to back: rank r's block i at `base_address + (r * num_blocks + i) *
block_size_bytes`). Two sides whose TP sizes differ split a block's heads differently, so their
digests never match: the checksum needs equal TP sizes. CPU memory only (a CUDA region would be
read through the host first).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import xxhash

from kvtransfer.base import KVLayout, KVTransferError


class ChecksumMismatch(KVTransferError):
    """The blocks that landed do not digest to what the sender wrote (or it sent no digest)."""


def kv_digest(layout: KVLayout, block_ids: Sequence[int]) -> int:
    """The digest of `block_ids` in the region `layout` describes (never 0: 0 means "none sent")."""
    if not str(layout.device).startswith("cpu"):
        raise ValueError(f"the KV checksum reads CPU memory, not {layout.device}")
    digest = xxhash.xxh3_64()
    size, rank_bytes = layout.block_size_bytes, layout.num_blocks * layout.block_size_bytes
    for block_id in block_ids:
        for rank in range(layout.tp_size):
            address = layout.base_address + rank * rank_bytes + block_id * size
            digest.update((ctypes.c_char * size).from_address(address))
    return digest.intdigest() or 1


def flip_byte(layout: KVLayout, block_id: int) -> None:
    """Invert the first byte of `block_id` (rank 0's copy): the `corrupt_transfers` fault."""
    cell = ctypes.c_ubyte.from_address(layout.base_address + block_id * layout.block_size_bytes)
    cell.value ^= 0xFF
