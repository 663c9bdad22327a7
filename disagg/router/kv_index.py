"""`--policy cache_aware` fed by KV events: what each prefill (server, DP rank) holds in its prefix
cache, from the KVEventBatch stream its workers publish (`--kv-events-config`, vLLM's format). Pure:
the subscriber (kv_subscriber.py) applies batches, the picker asks.

A tenant's index is the set of block hashes it stored and has not removed, and its block size.
A request's match on a tenant is its longest run of leading full blocks in that set, in tokens:
the request's block hashes are computed as the engine computes them (disagg/block_hashes.py; one
Python version on both sides). The router asks the index only once every eligible tenant has sent a
batch; until then, and for text it could not tokenize, the approximate radix trees decide.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from disagg.block_hashes import block_hashes
from disagg.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class KVIndex:
    def __init__(self):
        self._blocks: dict[Hashable, set[int]] = {}
        self._block_size: dict[Hashable, int] = {}

    def apply(self, tenant: Hashable, batch: KVEventBatch) -> None:
        """One published batch of `tenant`'s events, in order."""
        blocks = self._blocks.setdefault(tenant, set())
        for event in batch.events:
            if isinstance(event, BlockStored):
                blocks.update(h for h in event.block_hashes if isinstance(h, int))
                self._block_size[tenant] = event.block_size
            elif isinstance(event, BlockRemoved):
                blocks.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()

    def knows(self, tenant: Hashable) -> bool:
        """`tenant` has published at least one batch."""
        return tenant in self._blocks

    def forget(self, tenant: Hashable) -> None:
        """Drop `tenant` (its server left, its worker restarted: a new stream starts from nothing)."""
        self._blocks.pop(tenant, None)
        self._block_size.pop(tenant, None)

    def num_blocks(self, tenant: Hashable) -> int:
        return len(self._blocks.get(tenant, ()))

    def match_tokens(self, tenant: Hashable, token_ids: Sequence[int]) -> int:
        """Leading tokens of `token_ids` in full blocks `tenant` holds."""
        blocks, block_size = self._blocks.get(tenant), self._block_size.get(tenant)
        if not blocks or not block_size:
            return 0
        matched = 0
        for h in block_hashes(token_ids, block_size):
            if h not in blocks:
                break
            matched += block_size
        return matched


class IndexTrees:
    """The KV index seen through the trees' interface that `prefix_tree.pick_by_cache` reads: a
    tenant's size is the tokens it holds, its match the request's leading tokens it holds; an
    insert changes nothing (the tenant's own events will say what it stored)."""

    def __init__(self, index: KVIndex):
        self.index = index

    def size(self, tenant: Hashable) -> int:
        return self.index.num_blocks(tenant)

    def match_length(self, tenant: Hashable, token_ids: Sequence[int]) -> int:
        return self.index.match_tokens(tenant, token_ids)

    def insert(self, tenant: Hashable, token_ids: Sequence[int]) -> None:
        pass
