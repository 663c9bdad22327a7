"""A DP worker's KV event publisher: vLLM's ZmqEventPublisher, wire for wire.

After each turn of the worker loop the engine's recorded events become one KVEventBatch (with the
worker's DP rank), sent by a thread as ZMQ PUB multipart `(topic, seq as 8-byte big-endian,
msgpack payload)`; seq counts from 0. The last `buffer_steps` batches are kept for the replay
socket (a ROUTER): a request `(b"", start seq)` is answered with every kept batch from that seq on,
each `(b"", seq, payload)`, then `(b"", seq -1, b"")`. As in vLLM, the PUB socket binds an endpoint
with a wildcard (`*`, `::`) or an ipc path and connects to any other; the replay socket binds.
zmq is imported here only, in worker processes whose server enables events.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque

import msgspec
import structlog

from disagg.engine import kv_events as engine_events
from disagg.kv_events_config import KVEventsConfig
from disagg.wire import kv_events as wire

log = structlog.get_logger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_S = 0.1  # how long the thread waits for a batch before looking at the replay socket again
CLOSE_TIMEOUT_S = 5.0


def medium_of(device: str) -> str:
    """Where a worker's KV blocks live, as an event's `medium`: "GPU" on CUDA, else "CPU"."""
    return "GPU" if device.startswith("cuda") else "CPU"


def to_wire(event: engine_events.KVCacheEvent, block_size: int, medium: str) -> wire.KVCacheEvent:
    """One engine event as vLLM's struct (no LoRA here: lora_id is None)."""
    if isinstance(event, engine_events.BlockStored):
        return wire.BlockStored(list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
                                block_size, None, medium)
    if isinstance(event, engine_events.BlockRemoved):
        return wire.BlockRemoved(list(event.block_hashes), medium)
    return wire.AllBlocksCleared()


def bind_or_connect(socket, endpoint: str) -> None:
    """vLLM's rule: a stable (wildcard or ipc) endpoint is bound, any other is connected to."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)


class ZmqEventPublisher:
    """Publishes one DP worker's KVEventBatches; `config` is already offset for the rank."""

    def __init__(self, config: KVEventsConfig, dp_rank: int, block_size: int, medium: str):
        import zmq  # only where events are enabled

        self._zmq = zmq
        self.dp_rank, self.block_size, self.medium = dp_rank, block_size, medium
        self.num_dropped = 0
        self._topic = config.topic.encode()
        self._queue: queue.Queue[wire.KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            bind_or_connect(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{dp_rank}", daemon=True)
        self._thread.start()
        log.info("publishing KV events", endpoint=config.endpoint, replay_endpoint=config.replay_endpoint)

    def publish(self, events: list[engine_events.KVCacheEvent]) -> None:
        """Queue one batch of the events (nothing when empty); a full queue drops it, counted."""
        if not events:
            return
        batch = wire.KVEventBatch(time.time(), [to_wire(e, self.block_size, self.medium) for e in events], self.dp_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            log.warning("KV event queue full; batch dropped", num_dropped=self.num_dropped)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = itertools.count()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = next(seqs), encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("invalid KV event replay request", num_frames=len(frames))
            return
        client_id, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client_id, b"", END_SEQ, b""))

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(CLOSE_TIMEOUT_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for socket in (self._pub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_publisher(config: KVEventsConfig, dp_rank: int, core) -> ZmqEventPublisher | None:
    """The publisher of DP worker `dp_rank` (its endpoints offset by the rank), with the engine's
    events turned on; None when the server does not publish events."""
    if not config.enabled:
        return None
    publisher = ZmqEventPublisher(config.for_dp_rank(dp_rank), dp_rank, core.block_size,
                                  medium_of(core.config.model.device))
    core.enable_kv_events()
    return publisher
