"""A prefill's or decode's P/D metrics under SGLang's and vLLM's names, so P/D dashboards built for
either read this server.

SGLang's (labels `model_name`, `engine_type` (prefill or decode), `tp_rank`, `pp_rank`, `dp_rank`):
the four queue gauges (`num_prefill_bootstrap_queue_reqs`, `num_prefill_inflight_queue_reqs`,
`num_decode_prealloc_queue_reqs`, `num_decode_transfer_queue_reqs`) and the failure counters
(`num_bootstrap_failed_reqs_total`, `num_transfer_failed_reqs_total`), read from the workers' load
reports at scrape time; the histograms `kv_transfer_speed_gb_s` and `kv_transfer_latency_ms`, one
observation a request. vLLM's NIXL connector's (labels `model_name`, `engine`):
`nixl_xfer_time_seconds`, `nixl_bytes_transferred` and `nixl_num_failed_transfers_total`, whichever
transfer backend moves the KV. A transfer is observed on the side that moved it: the prefill that
wrote it (push flow), the decode that read it (pull flow).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from disagg.config import DisaggregationMode
from disagg.dp.protocol import WorkerState

SGLANG_LABELS = ["model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"]
VLLM_LABELS = ["model_name", "engine"]
SPEED_BUCKETS_GB_S = (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400)  # SGLang's
LATENCY_BUCKETS_MS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)  # SGLang's
XFER_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)  # vLLM's
BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))  # vLLM's: 2 KiB to 8 GiB
QUEUES = (  # SGLang's gauge, its help, the PdStatsMsg field
    ("sglang:num_prefill_bootstrap_queue_reqs", "The number of requests in the prefill bootstrap queue.",
     "prefill_bootstrap"),
    ("sglang:num_prefill_inflight_queue_reqs", "The number of requests in the prefill inflight queue.",
     "prefill_inflight"),
    ("sglang:num_decode_prealloc_queue_reqs", "The number of requests in the decode prealloc queue.",
     "decode_prealloc"),
    ("sglang:num_decode_transfer_queue_reqs", "The number of requests in the decode transfer queue.",
     "decode_transfer"),
)


class _PdCollector:
    """The queues and failure counts of the workers' last (or fresh) load reports."""

    def __init__(self, model_name: str, worker_states: Callable[[], list[WorkerState]],
                 mode: Callable[[], DisaggregationMode]):
        self._model_name, self._worker_states, self._mode = model_name, worker_states, mode

    def describe(self) -> list[Metric]:
        return []  # keeps registration from calling collect() before the engine is up

    def collect(self) -> Iterator[Metric]:
        states = [s for s in self._worker_states() if s.pd is not None]
        if not states:
            return  # a unified server: no P/D queues
        engine_type = self._mode().value

        def sglang(s: WorkerState) -> list[str]:
            return [self._model_name, engine_type, "0", "0", str(s.dp_rank)]
        for name, doc, field_name in QUEUES:
            gauge = GaugeMetricFamily(name, doc, labels=SGLANG_LABELS)
            for s in states:
                gauge.add_metric(sglang(s), getattr(s.pd, field_name))
            yield gauge
        for name, doc, field_name in (
                ("sglang:num_bootstrap_failed_reqs", "The number of bootstrap failed requests.", "num_bootstrap_failed"),
                ("sglang:num_transfer_failed_reqs", "The number of transfer failed requests.", "num_transfer_failed")):
            counter = CounterMetricFamily(name, doc, labels=SGLANG_LABELS)
            for s in states:
                counter.add_metric(sglang(s), getattr(s.pd, field_name))
            yield counter
        failed = CounterMetricFamily("vllm:nixl_num_failed_transfers", "Number of failed NIXL KV Cache transfers.",
                                     labels=VLLM_LABELS)
        for s in states:
            failed.add_metric([self._model_name, str(s.dp_rank)], s.pd.num_transfer_failed)
        yield failed


class PdMetrics:
    """The P/D families of one server in `registry`."""

    def __init__(self, registry: CollectorRegistry, model_name: str, worker_states: Callable[[], list[WorkerState]],
                 mode: Callable[[], DisaggregationMode]):
        self.model_name, self._mode = model_name, mode
        reg = registry
        self.speed = Histogram("sglang:kv_transfer_speed_gb_s", "Histogram of KV cache transfer speed in GB/s.",
                               SGLANG_LABELS, buckets=SPEED_BUCKETS_GB_S, registry=reg)
        self.latency = Histogram("sglang:kv_transfer_latency_ms", "Histogram of KV cache transfer latency in ms.",
                                 SGLANG_LABELS, buckets=LATENCY_BUCKETS_MS, registry=reg)
        self.xfer_time = Histogram("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache "
                                   "transfers.", VLLM_LABELS, buckets=XFER_BUCKETS_S, registry=reg)
        self.xfer_bytes = Histogram("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per NIXL KV Cache "
                                    "transfers.", VLLM_LABELS, buckets=BYTES_BUCKETS, registry=reg)
        reg.register(_PdCollector(model_name, worker_states, mode))

    def observe_transfer(self, dp_rank: int, num_bytes: int, seconds: float) -> None:
        """One request's KV moved by this server (written by a prefill, read by a decode)."""
        sglang = (self.model_name, self._mode().value, "0", "0", str(dp_rank))
        self.speed.labels(*sglang).observe(num_bytes / seconds / 1e9)
        self.latency.labels(*sglang).observe(seconds * 1e3)
        self.xfer_time.labels(self.model_name, str(dp_rank)).observe(seconds)
        self.xfer_bytes.labels(self.model_name, str(dp_rank)).observe(num_bytes)
