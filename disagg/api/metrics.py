"""Prometheus metrics of one server: request counts, token counts, latencies and per-DP-worker load.

Each app owns its registry (no process-wide default registry), so two servers in one process, as in
tests, never share counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from disagg.api.pd_metrics import PdMetrics
from disagg.api.step_metrics import StepMetrics
from disagg.config import DisaggregationMode
from disagg.api.vllm_metrics import VllmMetrics
from disagg.dp.protocol import DispatchStats, WorkerState
from disagg.types import FinishReason
from disagg.wire.engine_msgs import KVStatsMsg, StepsMsg

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_WORKER_GAUGES = (
    ("disagg_num_requests_running", "requests running on the DP worker", "num_running"),
    ("disagg_num_requests_waiting", "requests waiting on the DP worker", "num_waiting"),
    ("disagg_num_free_blocks", "free KV cache blocks of the DP worker", "num_free_blocks"),
    ("disagg_num_total_blocks", "KV cache blocks of the DP worker", "num_total_blocks"),
    ("disagg_num_quarantined_blocks", "KV blocks of the DP worker held until no remote write can land",
     "num_quarantined_blocks"),
    ("disagg_worker_restarts", "times the DP worker of this rank was restarted after dying", "num_restarts"),
    ("disagg_worker_ready", "1 when the DP worker is alive and ready", None),
)


class _WorkerCollector:
    """Reads the workers' states at scrape time: gauges labelled by `dp_rank`."""

    def __init__(self, worker_states: Callable[[], list[WorkerState]]):
        self._worker_states = worker_states

    def describe(self) -> list[Metric]:
        return []  # keeps registration from calling collect() before the engine is up

    def collect(self) -> Iterator[Metric]:
        states = self._worker_states()
        for name, doc, attr in _WORKER_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["dp_rank"])
            for s in states:
                value = getattr(s, attr) if attr else int(s.alive and s.ready)
                family.add_metric([str(s.dp_rank)], value)
            yield family


class _DispatchCollector:
    """Reads the DP controller's cache_aware hits and misses at scrape time."""

    def __init__(self, dispatch_stats: Callable[[], DispatchStats]):
        self._dispatch_stats = dispatch_stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        stats = self._dispatch_stats()
        yield CounterMetricFamily("disagg_dp_cache_hits", "cache_aware DP picks whose worker's tree matched more than "
                                  "cache_threshold of the prompt", value=stats.num_cache_hits)
        yield CounterMetricFamily("disagg_dp_cache_misses", "cache_aware DP picks by the smallest tree or the least "
                                  "load", value=stats.num_cache_misses)


class ApiMetrics:
    """The counters and histograms the front door records, plus the per-worker gauges; `vllm` holds
    the same observations under vLLM's names and labels."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, worker_states: Callable[[], list[WorkerState]], model_name: str, dp_size: int,
                 dispatch_stats: Callable[[], DispatchStats] = DispatchStats,
                 take_step_reports: Callable[[], list[StepsMsg]] = list, max_model_len: int = 8192,
                 cache_info: dict[str, str] | None = None,
                 mode: Callable[[], DisaggregationMode] = lambda: DisaggregationMode.NULL):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("disagg_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=reg)
        self.prompt_tokens = Counter("disagg_prompt_tokens", "prompt tokens of finished requests", registry=reg)
        self.generation_tokens = Counter("disagg_generation_tokens", "generated tokens", registry=reg)
        self.ttft = Histogram("disagg_time_to_first_token_seconds", "time to the first token",
                              buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.tpot = Histogram("disagg_time_per_output_token_seconds", "time per output token after the first",
                              buckets=_TPOT_BUCKETS_S, registry=reg)
        self.e2e = Histogram("disagg_e2e_request_latency_seconds", "request latency, arrival to finish",
                             buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.kv_bootstrap_wait = Histogram("disagg_bootstrap_wait_seconds", "prefill: arrival until the decode's destination is known",
                                           buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.kv_prefill_compute = Histogram("disagg_prefill_compute_seconds", "prefill: arrival until the prompt is computed",
                                            buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.kv_transfer = Histogram("disagg_kv_transfer_seconds", "prefill: prompt computed and destination known until every block landed",
                                     buckets=_TPOT_BUCKETS_S + (5.0, 10.0), registry=reg)
        self.kv_bytes = Counter("disagg_kv_transfer_bytes", "KV bytes moved between prefill and decode (sent or received)",
                                registry=reg)
        self.kv_bandwidth = Histogram("disagg_kv_transfer_gb_per_s", "KV transfer bandwidth per request (GB/s)",
                                      buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64), registry=reg)
        self.decode_prefills = Counter("disagg_decode_prefills", "decode: requests whose prompt was prefilled remotely "
                                       "(its KV moved here) or locally (sent here alone: --max-local-prefill-tokens)",
                                       ["where"], registry=reg)
        self.kv_wait = Histogram("disagg_kv_wait_seconds", "decode: arrival until the request's KV is admitted",
                                 buckets=_LATENCY_BUCKETS_S, registry=reg)
        self.kv_failed = Counter("disagg_kv_transfer_failed", "decode: requests whose KV transfer failed, by reason "
                                 "(checksum: what landed is not what the prefill wrote, --kv-checksum)", ["reason"],
                                 registry=reg)
        self.refused = Counter("disagg_requests_refused", "new generate requests answered 429 at once (admission), by "
                               "its error code: too_many_waiting_requests, kv_cache_over_limit, ttft_over_objective",
                               ["reason"], registry=reg)
        self.faults = Counter("disagg_faults_injected", "faults injected on purpose (--enable-fault-injection)",
                              ["fault", "dp_rank"], registry=reg)
        reg.register(_WorkerCollector(worker_states))
        reg.register(_DispatchCollector(dispatch_stats))
        self.vllm = VllmMetrics(reg, model_name, dp_size, worker_states, max_model_len, cache_info)
        self.steps = StepMetrics(reg)
        self.pd = PdMetrics(reg, model_name, worker_states, mode)
        self._take_step_reports = take_step_reports

    def observe_request(self, num_prompt_tokens: int, num_output_tokens: int, ttft_s: float | None,
                        e2e_s: float, *, dp_rank: int = 0, finish_reason: FinishReason = FinishReason.STOP,
                        inter_token_s: Sequence[float] = (), queued_s: float | None = None, max_tokens: int = 0,
                        num_preemptions: int = 0) -> None:
        """Record one finished generation (here and under vLLM's names)."""
        self.vllm.observe_request(dp_rank, finish_reason, num_prompt_tokens, num_output_tokens, ttft_s,
                                  inter_token_s, e2e_s)
        self.vllm.observe_phases(dp_rank, queued_s, ttft_s, e2e_s, num_prompt_tokens, num_output_tokens, max_tokens,
                                 num_preemptions)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if num_output_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def transfer_failed(self, reason: str) -> None:
        """A request whose KV transfer failed, by reason (SGLang's count comes from the workers)."""
        self.kv_failed.labels(reason).inc()

    def observe_kv(self, kv: KVStatsMsg, dp_rank: int = 0) -> None:
        """Record a disaggregated request's time split (prefill side) or KV wait (decode side), and the
        KV bytes it moved: written (push, prefill side), landed or read (decode side); the transfer
        under SGLang's and vLLM's names on the side that moved it."""
        if kv.transfer_s > 0:
            self.pd.observe_transfer(dp_rank, kv.kv_bytes, kv.transfer_s)
        if kv.kv_wait_s:
            self.kv_wait.observe(kv.kv_wait_s)
            self.kv_bytes.inc(kv.kv_bytes)
            return
        self.kv_bootstrap_wait.observe(kv.bootstrap_wait_s)
        self.kv_prefill_compute.observe(kv.prefill_compute_s)
        self.kv_transfer.observe(kv.transfer_s)
        self.kv_bytes.inc(kv.kv_bytes)
        if kv.transfer_s > 0:
            self.kv_bandwidth.observe(kv.kv_bytes / kv.transfer_s / 1e9)

    def render(self) -> bytes:
        """The Prometheus text exposition (the engine steps reported since the last one observed first)."""
        reports = self._take_step_reports()
        self.steps.observe_reports(reports)
        self.vllm.observe_steps(reports)
        return generate_latest(self.registry)

    def middleware(self):
        """An aiohttp middleware counting every request by endpoint (route pattern) and status."""

        @web.middleware
        async def count_requests(request: web.Request, handler) -> web.StreamResponse:
            resource = request.match_info.route.resource
            endpoint = resource.canonical if resource is not None else "unmatched"
            try:
                response = await handler(request)
            except asyncio.CancelledError:
                self.requests.labels(endpoint, "499").inc()  # the client went away
                raise
            self.requests.labels(endpoint, str(response.status)).inc()
            return response

        return count_requests
