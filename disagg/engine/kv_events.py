"""What the prefix-hash index did, as plain values: the block pool records them when asked to (a
worker publishing KV events), and the owner drains them after each step. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks entered the index: their hashes (each chains the one before), the hash
    of the block before the first (None at a sequence's start) and every token id they hold."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """A block left the index: its id was reallocated (evicted)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole index was dropped (reset_prefix_cache, sleep)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
