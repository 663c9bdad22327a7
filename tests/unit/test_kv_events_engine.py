"""The engine's KV events on the tiny model (block_size 4): what enters the prefix-hash index, what
leaves it, and clearing it, with exact hashes, parents and token ids."""

from __future__ import annotations

from disagg.engine.core import EngineCore
from disagg.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.types import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
A = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
B = [21, 22, 23, 24, 25, 26, 27, 28]


def block_hash(parent, tokens):
    """The engine's chain (kv_cache_manager): a block's hash is Python's hash of (parent hash, its
    tokens), the first block's parent hash 0."""
    return hash((0 if parent is None else parent, tuple(tokens)))


def engine(loaded, num_blocks=64) -> EngineCore:
    config = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"),
                          cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64))
    core = EngineCore(config, loaded)
    core.enable_kv_events()
    return core


def run(core, request_id, prompt) -> None:
    core.add_request(request_id, prompt, ONE)
    while core.has_unfinished():
        core.step()


def test_a_prompt_stores_its_full_blocks_as_one_chain(tiny_loaded):
    core = engine(tiny_loaded)
    assert core.take_kv_events() == []
    run(core, "a", A)  # 10 tokens: blocks [5..8] and [9..12] are full; [13, 14] is not
    h0 = block_hash(None, A[:4])
    h1 = block_hash(h0, A[4:8])
    assert core.take_kv_events() == [BlockStored((h0, h1), None, tuple(A[:8]))]
    assert core.take_kv_events() == []  # drained
    shared = A[:4] + [40, 41, 42, 43, 44]  # hits the first block, stores its own second
    run(core, "b", shared)
    assert core.take_kv_events() == [BlockStored((block_hash(h0, shared[4:8]),), h0, tuple(shared[4:8]))]
    assert all(-(2**63) <= h < 2**63 for h in (h0, h1))  # msgpack int64
    assert core.reset_prefix_cache() is True
    assert core.take_kv_events() == [AllBlocksCleared()]


def test_reusing_a_cached_block_removes_it(tiny_loaded):
    core = engine(tiny_loaded, num_blocks=3)
    run(core, "a", A[:8])  # blocks 0 and 1, both cached; freed tail first: the free queue is [2, 1, 0]
    a0, a1 = block_hash(None, A[:4]), block_hash(block_hash(None, A[:4]), A[4:8])
    assert core.take_kv_events() == [BlockStored((a0, a1), None, tuple(A[:8]))]
    run(core, "b", B)  # takes blocks 2 and 1: block 1's hash leaves the index
    b0 = block_hash(None, B[:4])
    assert core.take_kv_events() == [BlockRemoved((a1,)), BlockStored((b0, block_hash(b0, B[4:8])), None, tuple(B))]
    assert core.kv.pool.lookup(a0) == 0 and core.kv.pool.lookup(a1) is None
    core.kv.pool.check_integrity()


def test_sleep_clears_the_index_once(tiny_loaded):
    core = engine(tiny_loaded)
    run(core, "a", A)
    core.take_kv_events()
    core.sleep(1)
    assert core.take_kv_events() == [AllBlocksCleared()]
    core.wake_up()
    assert core.take_kv_events() == []


def test_events_are_not_recorded_unless_enabled(tiny_loaded):
    core = EngineCore(EngineConfig(model=ModelConfig(model="tiny", dtype="float32"),
                                   cache=CacheConfig(block_size=4, num_blocks=16)), tiny_loaded)
    run(core, "a", A)
    assert core.kv.pool.events is None
    assert core.take_kv_events() == []


def test_no_prefix_caching_no_events(tiny_loaded):
    core = EngineCore(EngineConfig(model=ModelConfig(model="tiny", dtype="float32"),
                                   cache=CacheConfig(block_size=4, num_blocks=16, enable_prefix_caching=False)),
                      tiny_loaded)
    core.enable_kv_events()
    run(core, "a", A)
    assert core.take_kv_events() == []
