"""The KV checksum (`--kv-checksum`): one 64-bit xxh3 digest over the blocks a room moves, the sender's
over what it wrote, the receiver's over what landed. Equal digests: every byte arrived as sent.

Block ids in the order given; each block's bytes as a cache of TP size 1 holds them, whatever the
TP size of the side: each row (layer, K or V, token) holds every KV head in order, each head taken
from the first rank that holds it (kvtransfer/heads.py). A TP group's region holds its ranks' caches
back to back (rank r's block i at `base_address + (r * num_blocks + i) * block_size_bytes`), so its
blocks are gathered into that order first; a TP-1 side digests its blocks as they lie. So a prefill
and a decode of different TP sizes digest the same KV alike. CPU memory only (a CUDA region would be
read through the host first).

Neither digest needs to be a pass of its own after the transfer: the sender may write a room's blocks
in pieces (`pieces`; the sizes: disagg/pd_config.py) and digest each as soon as it posted it (the bytes
the copy just read, still in cache), and the receiver digest each once its notification says it landed
(`LandedDigest`), while the next pieces move. What is left at the end is the last piece.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import xxhash

from kvtransfer.base import KVLayout, KVTransferError
from kvtransfer.heads import head_row_bytes, head_sources, rank_heads


class ChecksumMismatch(KVTransferError):
    """The blocks that landed do not digest to what the sender wrote (or it sent no digest)."""


class KVDigest:
    """The digest of blocks added a few at a time, in order: equal to kv_digest of them all at once. The
    prefill of the push flow adds each write's blocks as it posts the write, so it digests while they
    move rather than after."""

    def __init__(self, layout: KVLayout):
        if not str(layout.device).startswith("cpu"):
            raise ValueError(f"the KV checksum reads CPU memory, not {layout.device}")
        self.layout, self._digest = layout, xxhash.xxh3_64()
        size = layout.block_size_bytes
        self._region = None if layout.tp_size == 1 else np.ctypeslib.as_array(
            (ctypes.c_uint8 * (layout.tp_size * layout.num_blocks * size)).from_address(layout.base_address))

    def update(self, block_ids: Sequence[int]) -> KVDigest:
        size = self.layout.block_size_bytes
        for block_id in block_ids:
            self._digest.update((ctypes.c_char * size).from_address(self.layout.base_address + block_id * size)
                                if self._region is None else _as_one_rank(self.layout, self._region, block_id))
        return self

    def value(self) -> int:
        """The digest so far (never 0: 0 means "none sent")."""
        return self._digest.intdigest() or 1


def pieces(start: int, end: int, layout: KVLayout, piece_bytes: int) -> Iterator[tuple[int, int]]:
    """[start, end) of a write's blocks in runs of about `piece_bytes` (at least one block each; 0: one run)."""
    step = max(1, piece_bytes // (layout.block_size_bytes * layout.tp_size)) if piece_bytes > 0 else max(end - start, 1)
    for first in range(start, end, step):
        yield first, min(first + step, end)


MAX_TAG_DIGITS = 20  # a room is a 63-bit integer: a longer number in a tag is no piece of ours


def piece_tag(room: int, start: int, end: int) -> bytes:
    """The notification tag of a write of `room`'s blocks [start, end) (offsets into the receiver's)."""
    return b"room:%d:%d:%d" % (room, start, end)


def piece_of(tag: bytes) -> tuple[int, int, int] | None:
    """(room, start, end) of a piece's tag; None for any other notification (or a malformed one: a
    peer's tag never raises here)."""
    parts = tag.split(b":")
    if len(parts) != 4 or parts[0] != b"room":
        return None
    if not all(p.isdigit() and len(p) <= MAX_TAG_DIGITS for p in parts[1:]):
        return None
    room, start, end = map(int, parts[1:])
    return room, start, end


class LandedDigest:
    """The receiver's digest of blocks that land in pieces, in any order: each piece is digested once
    the pieces before it are (a digest reads blocks in order), so most of the work is done by the time
    the last piece lands. `value()` digests whatever was not reported and gives the whole digest."""

    def __init__(self, layout: KVLayout, block_ids: Sequence[int], before_first: Callable[[], None] | None = None):
        self.block_ids = tuple(block_ids)
        self._digest, self._next, self._landed = KVDigest(layout), 0, {}  # start -> end of reported pieces
        self._before_first = before_first  # run once, just before the first block is read (a fault's flip)

    def landed(self, start: int, end: int) -> None:
        """Blocks `block_ids[start:end]` landed (a piece's notification)."""
        if not 0 <= start < end <= len(self.block_ids) or start < self._next:
            return  # not a piece of ours, or one already digested: the final digest reads what is there
        self._landed[start] = max(end, self._landed.get(start, end))
        while self._next in self._landed:
            self._read(self._landed.pop(self._next))

    def _read(self, end: int) -> None:
        if self._next == 0 and self._before_first is not None:
            self._before_first()
        self._digest.update(self.block_ids[self._next:end])
        self._next = end

    @property
    def num_digested(self) -> int:
        return self._next

    def value(self) -> int:
        if self._next < len(self.block_ids):
            self._read(len(self.block_ids))
        return self._digest.value()


def kv_digest(layout: KVLayout, block_ids: Sequence[int]) -> int:
    """The digest of `block_ids` in the region `layout` describes (never 0: 0 means "none sent")."""
    return KVDigest(layout).update(block_ids).value()


def _as_one_rank(layout: KVLayout, region: np.ndarray, block_id: int) -> np.ndarray:
    """Block `block_id` of a TP group's region, as a TP-1 cache lays it out (a new array)."""
    heads, head_bytes, size = layout.num_kv_heads, head_row_bytes(layout), layout.block_size_bytes
    rows = layout.num_layers * 2 * layout.block_size_tokens
    parts = []
    for start, end, rank in head_sources(heads, layout.tp_size, 1)[0]:
        first = rank_heads(heads, layout.tp_size, rank)[0]
        offset = (rank * layout.num_blocks + block_id) * size
        block = region[offset:offset + size].reshape(rows, -1)
        parts.append(block[:, (start - first) * head_bytes:(end - first) * head_bytes])
    return np.concatenate(parts, axis=1)


def flip_byte(layout: KVLayout, block_id: int) -> None:
    """Invert the first byte of `block_id` (rank 0's copy): the `corrupt_transfers` fault."""
    cell = ctypes.c_ubyte.from_address(layout.base_address + block_id * layout.block_size_bytes)
    cell.value ^= 0xFF
