"""/metrics' summary of the workers' per-step engine metrics (disagg.engine.step_metrics): each scrape
hands over the reports that arrived since the last one and every step is observed, per DP rank."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from disagg.wire.engine_msgs import StepsMsg

_STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (0, 1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_SEQ_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class StepMetrics:
    """The histograms, counters and gauges of the engine steps, labelled by `dp_rank`."""

    def __init__(self, registry: CollectorRegistry):
        labels = ["dp_rank"]
        self.wall = Histogram("disagg_engine_step_seconds", "wall time of an engine step that ran the model",
                              labels, buckets=_STEP_BUCKETS_S, registry=registry)
        self.prefill = Histogram("disagg_engine_step_prefill_tokens", "prompt tokens one engine step computed",
                                 labels, buckets=_TOKEN_BUCKETS, registry=registry)
        self.decode = Histogram("disagg_engine_step_decode_seqs", "requests one engine step decoded",
                                labels, buckets=_SEQ_BUCKETS, registry=registry)
        self.decode_kv = Counter("disagg_engine_step_decode_kv_tokens", "KV tokens the decoding requests of every "
                                 "engine step attended over, summed", labels, registry=registry)
        self.waiting = Gauge("disagg_engine_step_waiting", "requests queued after the last engine step reported",
                             labels, registry=registry)

    def observe_reports(self, reports: Sequence[StepsMsg]) -> None:
        """Observe every step of the reports that arrived since the last scrape."""
        for report in reports:
            rank = str(report.dp_rank)
            for step in report.steps:
                self.wall.labels(rank).observe(step.wall_s)
                self.prefill.labels(rank).observe(step.num_prefill_tokens)
                self.decode.labels(rank).observe(step.num_decode_seqs)
                self.decode_kv.labels(rank).inc(step.num_decode_kv_tokens)
            if report.steps:
                self.waiting.labels(rank).set(report.steps[-1].num_waiting)
