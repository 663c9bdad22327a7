"""KV events encode exactly as vLLM's: its struct definitions (vllm/distributed/kv_events.py) are
transcribed here, independent of disagg/wire/kv_events.py, and both sides must agree byte for byte."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from disagg.config import ConfigError
from disagg.worker.kv_events import to_wire
from disagg.engine import kv_events as engine_events
from disagg.kv_events_config import KVEventsConfig, parse_kv_events_config
from disagg.wire import kv_events as ours

# --- vLLM's definitions, as vLLM writes them --------------------------------------------------
ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
# -----------------------------------------------------------------------------------------------

H1, H2, H3 = -(2**63), 2**63 - 1, 1234567  # Python's hash range: signed 64-bit
ENGINE_EVENTS = [
    engine_events.BlockStored((H1, H2), None, (1, 2, 3, 4, 5, 6, 7, 8)),
    engine_events.BlockStored((H3,), H2, (9, 10, 11, 12)),
    engine_events.BlockRemoved((H1,)),
    engine_events.AllBlocksCleared(),
]
VLLM_EVENTS = [
    BlockStored([H1, H2], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "CPU"),
    BlockStored([H3], H2, [9, 10, 11, 12], 4, None, "CPU"),
    BlockRemoved([H1], "CPU"),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("rank", [0, 3, None])
def test_our_batch_is_vllms_bytes_and_decodes_with_vllms_decoder(rank):
    batch = ours.KVEventBatch(1700000000.25, [to_wire(e, 4, "CPU") for e in ENGINE_EVENTS], rank)
    payload = ours.encode_batch(batch)
    assert payload == msgspec.msgpack.Encoder().encode(KVEventBatch(1700000000.25, VLLM_EVENTS, rank))
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert decoded == KVEventBatch(1700000000.25, VLLM_EVENTS, rank)
    assert ours.decode_batch(payload) == batch


def test_the_layout_on_the_wire():
    payload = ours.encode_batch(ours.KVEventBatch(2.5, [to_wire(e, 4, "GPU") for e in ENGINE_EVENTS[1:]], 1))
    assert msgspec.msgpack.decode(payload) == [
        2.5, [["BlockStored", [H3], H2, [9, 10, 11, 12], 4, None, "GPU"], ["BlockRemoved", [H1], "GPU"],
              ["AllBlocksCleared"]], 1]
    # omit_defaults does not shorten an array_like struct: an unset rank is sent as nil
    assert msgspec.msgpack.decode(ours.encode_batch(ours.KVEventBatch(2.5, []))) == [2.5, [], None]


def test_config_takes_vllms_json_with_its_defaults():
    config = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:6000", '
                                    '"replay_endpoint": "tcp://127.0.0.1:7000", "topic": "kv"}')
    assert config == KVEventsConfig(True, "zmq", "tcp://127.0.0.1:6000", "tcp://127.0.0.1:7000", 10_000, 100_000,
                                    100_000, "kv")
    assert config.enabled
    assert config.for_dp_rank(2).endpoint == "tcp://127.0.0.1:6002"
    assert config.for_dp_rank(2).replay_endpoint == "tcp://127.0.0.1:7002"
    assert KVEventsConfig(True, endpoint="ipc:///tmp/ev").for_dp_rank(1).endpoint == "ipc:///tmp/ev_dp1"
    assert parse_kv_events_config(None).publisher == "null" and not parse_kv_events_config(None).enabled
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled


@pytest.mark.parametrize("text, message", [
    ("{nope", "--kv-events-config is not valid JSON"),
    ("[1]", "--kv-events-config must be a JSON object, got '[1]'"),
    ('{"enable": true}', "--kv-events-config has unknown field(s) enable; known: buffer_steps, enable_kv_cache_events, "
                         "endpoint, hwm, max_queue_size, publisher, replay_endpoint, topic"),
    ('{"publisher": "kafka"}', "kv_events_config.publisher must be one of null, zmq, got 'kafka'"),
    ('{"hwm": 0}', "kv_events_config.hwm must be a positive integer, got 0"),
    ('{"endpoint": "udp://x:1"}', "kv_events_config.endpoint must be a tcp:// or ipc:// address, got 'udp://x:1'"),
    ('{"replay_endpoint": "tcp://*"}', "kv_events_config.replay_endpoint must end in a port (tcp://host:port), got 'tcp://*'"),
])
def test_bad_config_is_a_config_error_naming_the_field(text, message):
    with pytest.raises(ConfigError) as info:
        parse_kv_events_config(text)
    assert str(info.value).startswith(message)


def test_the_cli_refuses_bad_json_before_anything_starts():
    from disagg import cli

    with pytest.raises(ConfigError, match="--kv-events-config has unknown field"):
        cli.run(["unified", "--model", "tiny", "--kv-events-config", '{"enable_kv_cache_event": true}'])
