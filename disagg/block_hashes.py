"""The prefix-cache hash of a KV block, shared by the engine (its index, its KV events) and the
router (which matches a request's blocks against the events). Pure.

A block's hash chains its parent's hash with its tokens, so equal hashes mean equal prefixes:
Python's hash of (parent hash, token ids), a signed 64-bit int. Ints and tuples of ints hash the
same in every process of one Python version (PYTHONHASHSEED salts str and bytes only), so every
worker, and a router on the same Python, gives a prefix the same hashes.
"""

from __future__ import annotations

from collections.abc import Sequence

# The parent of a sequence's first block. Not None: before Python 3.12 hash(None) is its address,
# which differs between processes.
ROOT_BLOCK_HASH = 0


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The hash of a full block: its parent's hash chained with its tokens."""
    return hash((parent, tuple(token_ids)))


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hashes of every full block of `token_ids`, in order."""
    hashes, parent = [], ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
