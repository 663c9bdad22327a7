"""The plain values an engine hands its callers about requests and its cache: how far a request is,
what a remote-KV reservation holds, where the KV cache lives, the engine's load. No logic."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestProgress:
    """How far a request is: its blocks, computed tokens, whether it finished (the P/D roles read it)."""

    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    finished: bool


@dataclass(frozen=True)
class Reservation:
    """Blocks reserved for a prompt whose KV another engine writes. The first `num_cached_tokens`
    (whole blocks) are this engine's own prefix hits; the blocks after them need the remote KV."""

    block_ids: list[int]
    num_prompt_tokens: int
    num_cached_tokens: int
    block_size: int

    @property
    def num_cached_blocks(self) -> int:
        return self.num_cached_tokens // self.block_size

    @property
    def new_block_ids(self) -> list[int]:
        """The blocks the remote KV goes into."""
        return self.block_ids[self.num_cached_blocks:]


@dataclass(frozen=True)
class CacheSpec:
    """Where the KV cache lives and how it is shaped: `tp_size` [num_blocks, num_layers, 2, block_size,
    rank's kv heads, head_dim] caches back to back; `num_kv_heads` is the model's."""

    base_address: int
    num_blocks: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    tp_size: int = 1


@dataclass(frozen=True)
class EngineStats:
    """Load and KV cache occupancy (the DP workers report it as StatsMsg)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_quarantined_blocks: int  # a remote writer may still write them: neither free nor in use
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache so far
    prefix_cache_hits: int = 0  # of them, found cached
