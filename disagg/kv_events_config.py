"""`--kv-events-config`: vLLM's KVEventsConfig, given as the same JSON vLLM takes.

A server whose config enables events has every DP worker publish the prefix-cache changes of its
block pool (docs/router.md, "KV events"). Like vLLM, DP worker `r` publishes on the endpoint's port
plus `r` (and serves replays on the replay endpoint's port plus `r`), so the workers of one server
never share a socket.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from disagg.config import ConfigError

PUBLISHERS = ("null", "zmq")
KV_EVENTS_HELP = ("vLLM's KVEventsConfig as JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                  "\"endpoint\": \"tcp://*:5557\"}': every DP worker publishes its prefix-cache changes "
                  "(KVEventBatch, msgpack) over ZMQ PUB; DP worker r uses the endpoint's port + r")


@dataclass(frozen=True)
class KVEventsConfig:
    """The fields of vLLM's KVEventsConfig, with its defaults. `publisher` unset resolves as in vLLM:
    "zmq" when events are enabled, else "null"."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; beyond, a batch is dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ConfigError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"kv_events_config.{name} must be a positive integer, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(("tcp://", "ipc://"))):
                raise ConfigError(f"kv_events_config.{name} must be a tcp:// or ipc:// address, got {value!r}")
            if value is not None and value.startswith("tcp://"):
                _check_port(value, name)
        if not isinstance(self.enable_kv_cache_events, bool) or not isinstance(self.topic, str):
            raise ConfigError("kv_events_config.enable_kv_cache_events must be a boolean and topic a string")

    @property
    def enabled(self) -> bool:
        """True when the workers collect and publish events (enabled with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_dp_rank(self, rank: int) -> KVEventsConfig:
        """The config DP worker `rank` publishes with: both endpoints offset by the rank."""
        return dataclasses.replace(self, endpoint=offset_endpoint(self.endpoint, rank),
                                   replay_endpoint=offset_endpoint(self.replay_endpoint, rank))


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's offset_endpoint_port: a tcp endpoint's port plus the DP rank; an ipc path gets `_dp<rank>`."""
    if endpoint is None:
        return None
    if endpoint.startswith("ipc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def parse_kv_events_config(text: str | None) -> KVEventsConfig:
    """`--kv-events-config`'s JSON as a KVEventsConfig (disabled when None); ConfigError naming what is wrong."""
    if text is None:
        return KVEventsConfig()
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kv-events-config is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--kv-events-config must be a JSON object, got {text!r}")
    known = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"--kv-events-config has unknown field(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")
    return KVEventsConfig(**values)


def _check_port(endpoint: str, name: str) -> None:
    port = endpoint.rpartition(":")[2]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"kv_events_config.{name} must end in a port (tcp://host:port), got {endpoint!r}")
