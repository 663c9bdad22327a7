"""A DP worker's per-step engine metrics, reported twice a second: to its front (which summarises them
on /metrics) and, with `--step-metrics-endpoint`, on ZMQ PUB for a planner, as the KV events go.

A ZMQ report is the multipart `(b"step_metrics", seq as 8-byte big-endian, msgpack StepsMsg)`; worker
r publishes on the endpoint's port plus r (an ipc path plus `_dp<r>`), binding a wildcard or ipc
endpoint and connecting to any other (vLLM's rule for its KV events). A report the socket cannot
take at once (past its high-water mark) is dropped: the front still gets every step.
"""

from __future__ import annotations

import itertools

from disagg.engine.step_metrics import StepMetrics
from disagg.kv_events_config import offset_endpoint
from disagg.wire.engine_msgs import StepMsg, StepsMsg, encode
from disagg.worker.kv_events import bind_or_connect

TOPIC = b"step_metrics"
SEND_HWM = 10_000


class StepReporter:
    """Turns a worker's steps into numbered StepsMsg reports, and publishes them when asked to."""

    def __init__(self, dp_rank: int, endpoint: str | None = None):
        self.dp_rank = dp_rank
        self._seq = itertools.count()
        self._context = self._socket = None
        if endpoint is not None:
            import zmq  # only where the server publishes step metrics

            self._zmq = zmq
            self._context = zmq.Context()
            self._socket = self._context.socket(zmq.PUB)
            self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
            self._socket.setsockopt(zmq.LINGER, 0)
            bind_or_connect(self._socket, offset_endpoint(endpoint, dp_rank))

    def report(self, steps: list[StepMetrics]) -> StepsMsg | None:
        """The report of `steps` (None when there are none), published on ZMQ when configured."""
        if not steps:
            return None
        msg = StepsMsg(self.dp_rank, next(self._seq), [StepMsg(
            s.wall_s, s.num_prefill_tokens, s.num_decode_seqs, s.num_decode_kv_tokens, s.num_running, s.num_waiting)
            for s in steps])
        if self._socket is not None:
            try:
                self._socket.send_multipart([TOPIC, msg.seq.to_bytes(8, "big"), encode(msg)], flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                pass  # past the high-water mark: this report is dropped on ZMQ (the front has it)
        return msg

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._context.term()
            self._socket = self._context = None
