"""KV cache events as vLLM publishes them (vllm/distributed/kv_events.py): the same msgspec structs,
so `msgspec.msgpack.Encoder().encode(batch)` gives vLLM's bytes and vLLM's decoder reads ours.

Each struct is a msgpack array (`array_like`: every field, an unset rank as nil); an event's first
element is its class name (`tag`).
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM sends a block hash as an int or as bytes; ours are ints (signed 64-bit, see docs/router.md).
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publication: the wall-clock time, the events, the DP rank of the worker that sent them."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events; the tag (the class name) is each event's first element."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: their hashes (a parent chain, first to last), the hash
    of the block before the first (None at the start of a sequence) and all their token ids."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted for reuse)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (reset_prefix_cache, sleep)."""


class KVEventBatch(EventBatch):
    """What a worker publishes after a step that changed its prefix cache."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encode_batch(batch: KVEventBatch, encoder: msgspec.msgpack.Encoder | None = None) -> bytes:
    """The batch's msgpack bytes, as vLLM's publisher encodes them."""
    return (encoder or msgspec.msgpack.Encoder()).encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A published payload back as a KVEventBatch (what a subscriber does)."""
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
