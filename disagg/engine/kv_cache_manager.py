"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, caching full blocks, freeing.

Pure Python, on top of the block pool. A block's hash (disagg/block_hashes.py) chains its parent's
hash with its tokens, so equal hashes mean equal prefixes; every worker gives a prefix the same
hashes, and KV events name blocks by them.
"""

from __future__ import annotations

from collections.abc import Sequence

from disagg.block_hashes import ROOT_BLOCK_HASH, block_hash, block_hashes
from disagg.engine.block_pool import BlockPool
from disagg.engine.kv_events import AllBlocksCleared, BlockStored, KVCacheEvent
from disagg.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks of the request's longest cached prefix, and how many tokens they cover.

        At least one token is always left to compute (its logits are needed). Requests that want
        prompt logprobs get no hits: their logits must be computed for every prompt token.
        """
        if not self.enable_caching or request.wants_prompt_logprobs:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, max_blocks)
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` are cached now (whole blocks, the last token never
        counted, as get_computed_blocks would find them); touches nothing."""
        if not self.enable_caching:
            return 0
        num_blocks = 0
        for h in block_hashes(token_ids[: len(token_ids) - 1], self.block_size):
            if self.pool.lookup(h) is None:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_block_ids: list[int] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after any prefix hits).

        Returns False, changing nothing, when the free blocks do not suffice.
        """
        num_tokens = request.num_computed_tokens + len(computed_block_ids) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(request.block_ids) - len(computed_block_ids)
        # Hits that sit in the free queue stop being free once touched.
        num_free_hits = sum(1 for b in computed_block_ids if self.pool.blocks[b].ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return False
        self.pool.touch(list(computed_block_ids))
        request.block_ids.extend(computed_block_ids)
        if num_new_blocks > 0:
            request.block_ids.extend(self.pool.allocate(num_new_blocks))
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index every block whose tokens are all computed, so later requests can reuse it."""
        if not self.enable_caching:
            return
        num_full = num_computed_tokens // self.block_size
        self._extend_hashes(request, num_full)
        new = [i for i in range(num_full) if self.pool.cache(request.block_ids[i], request.block_hashes[i])]
        if new and self.pool.events is not None:
            self._record_stored(request, new)

    def _record_stored(self, request: Request, new: list[int]) -> None:
        """One BlockStored per run of consecutive newly indexed blocks (a run's parent is the block before it)."""
        runs: list[list[int]] = []
        for i in new:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        bs, hashes = self.block_size, request.block_hashes
        for run in runs:
            first, end = run[0], run[-1] + 1
            self.pool.events.append(BlockStored(tuple(hashes[first:end]), hashes[first - 1] if first else None,
                                                tuple(request.all_token_ids[first * bs : end * bs])))

    def enable_events(self) -> None:
        """Record what the prefix-hash index does from now on (drained with take_events)."""
        if self.pool.events is None:
            self.pool.events = []

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (empty when events are off)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def free(self, request: Request) -> None:
        """Release the request's blocks; tail blocks first in the eviction order (least reusable)."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []

    def reset(self) -> None:
        """A fresh pool (the cache memory was reallocated: nothing in it is valid)."""
        assert self.pool.num_free_blocks == self.pool.num_blocks, "reset with blocks in use"
        events = self.pool.events
        if events is not None and self.pool.num_cached_blocks:
            events.append(AllBlocksCleared())
        self.pool = BlockPool(self.pool.num_blocks, self.enable_caching, events)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        tokens = request.all_token_ids
        bs = self.block_size
        while len(request.block_hashes) < num_blocks:
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if i else ROOT_BLOCK_HASH
            request.block_hashes.append(block_hash(parent, tokens[i * bs : (i + 1) * bs]))
