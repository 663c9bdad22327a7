"""The block pool: free list, reference counts and the prefix-hash index. Nothing else.

Pure Python. Block ids are ints in [0, num_blocks). A block with ref_cnt 0 sits in the free queue
(least recently freed first, which is the eviction order) and may still carry a hash that makes it
reusable as a prefix hit until it is evicted by a new allocation.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from disagg.engine.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent

BlockHash = int


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, events: list[KVCacheEvent] | None = None):
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # What the index did, for KV event publishers (None: nothing is recorded); the owner drains it.
        self.events = events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (first is evicted first)."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop `num_blocks` from the free queue (evicting their cached hashes); caller checked room."""
        assert num_blocks <= len(self._free), "allocate beyond free blocks"
        out = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"free block {block_id} has ref_cnt {block.ref_cnt}"
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block id cached under this hash, if any."""
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on blocks found by prefix lookup (removing them from the free queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Record that a full block holds the tokens hashed by `block_hash`; True when it entered the index."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False  # already cached, or an identical block is (keep the first)
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue in the given order."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"block {block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, as in vLLM."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block.block_id:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved((block.block_hash,)))
            block.block_hash = None

    def check_integrity(self) -> None:
        """Assert the pool's invariants (for tests): free queue == blocks with ref 0, index consistent."""
        zero = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert zero == set(self._free), f"free queue {sorted(self._free)} != ref-0 blocks {sorted(zero)}"
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash, f"index points at stale block {block_id}"
