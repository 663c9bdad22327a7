"""The metrics under vLLM's v1 names, so dashboards and autoscalers built for vLLM read this server.

Names, types and labels follow vLLM's PrometheusStatLogger: every family carries `model_name` (the
served model) and `engine` (vLLM's engine index; here the DP rank that served the request or whose
state the gauge reports); `vllm:request_success_total` adds `finished_reason` (stop, length, abort).
The `disagg_*` families stay beside these; both come from the same observations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from disagg.dp.protocol import WorkerState
from disagg.types import FinishReason
from disagg.wire.engine_msgs import StepsMsg

# vLLM's buckets (v1 loggers), so quantiles computed by vLLM dashboards mean the same here.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
N_BUCKETS = (1, 2, 5, 10, 20)
WAITING_REASONS = ("capacity", "deferred")  # vLLM's: waiting for room; waiting on something else (here: KV on its way)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
LABELS = ["model_name", "engine"]


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


class _VllmWorkerCollector:
    """vLLM's scheduler gauges, read from the DP workers' states at scrape time, and its cache config."""

    def __init__(self, model_name: str, worker_states: Callable[[], list[WorkerState]], cache_info: dict[str, str]):
        self._model_name = model_name
        self._worker_states = worker_states
        self._cache_info = cache_info

    def describe(self) -> list[Metric]:
        return []  # keeps registration from calling collect() before the engine is up

    def collect(self) -> Iterator[Metric]:
        states = self._worker_states()
        families = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", lambda s: s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             lambda s: s.num_waiting + s.num_waiting_deferred),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_cache_usage),
        )
        for name, doc, value in families:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for s in states:
                family.add_metric([self._model_name, str(s.dp_rank)], value(s))
            yield family
        by_reason = GaugeMetricFamily("vllm:num_requests_waiting_by_reason", "Number of requests waiting, by "
                                      "reason: capacity (room in the KV cache or the batch) or deferred (other "
                                      "constraints: a decode's KV on its way).", labels=LABELS + ["reason"])
        for s in states:
            by_reason.add_metric([self._model_name, str(s.dp_rank), "capacity"], s.num_waiting)
            by_reason.add_metric([self._model_name, str(s.dp_rank), "deferred"], s.num_waiting_deferred)
        yield by_reason
        if self._cache_info:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                     labels=[*self._cache_info, "engine"])
            for s in states:
                info.add_metric([*self._cache_info.values(), str(s.dp_rank)], 1)
            yield info
        counters = (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             lambda s: s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             lambda s: s.prefix_cache_hits),
        )
        for name, doc, value in counters:  # the worker's own count since it started (a restart resets it)
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            for s in states:
                counter.add_metric([self._model_name, str(s.dp_rank)], value(s))
            yield counter


def kv_cache_usage(state: WorkerState) -> float:
    """The fraction of the worker's KV blocks not free (vLLM's `1 - free / total`); 0 with no cache."""
    if state.num_total_blocks <= 0:
        return 0.0
    return 1.0 - state.num_free_blocks / state.num_total_blocks


class VllmMetrics:
    """vLLM-named counters and histograms in `registry`, plus the per-engine gauges."""

    def __init__(self, registry: CollectorRegistry, model_name: str, dp_size: int,
                 worker_states: Callable[[], list[WorkerState]], max_model_len: int = 8192,
                 cache_info: dict[str, str] | None = None):
        self.model_name = model_name
        reg = registry
        tokens = build_1_2_5_buckets(max_model_len)
        self.phases = {name: Histogram(f"vllm:request_{name}_time_seconds", doc, LABELS, buckets=E2E_BUCKETS_S,
                                       registry=reg) for name, doc in (
            ("queue", "Histogram of time spent in WAITING phase for request."),
            ("inference", "Histogram of time spent in RUNNING phase for request."),
            ("prefill", "Histogram of time spent in PREFILL phase for request."),
            ("decode", "Histogram of time spent in DECODE phase for request."))}
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               LABELS, buckets=tokens, registry=reg)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", LABELS, buckets=tokens,
                                                   registry=reg)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
                                    LABELS, buckets=tokens, registry=reg)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", LABELS,
                                   registry=reg)
        self.request_preemptions = Histogram("vllm:request_num_preemptions", "Number of preemptions a finished "
                                             "request went through.", LABELS, buckets=PREEMPTION_BUCKETS, registry=reg)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", LABELS, buckets=STEP_TOKEN_BUCKETS, registry=reg)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", LABELS,
                                  buckets=N_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS,
                                         registry=reg)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       LABELS + ["finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS_S, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, buckets=ITL_BUCKETS_S, registry=reg)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", LABELS,
                              buckets=ITL_BUCKETS_S, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=E2E_BUCKETS_S, registry=reg)
        reg.register(_VllmWorkerCollector(model_name, worker_states, cache_info or {}))
        for rank in range(dp_size):  # as vLLM: every series exists from the start, at 0
            labels = (model_name, str(rank))
            for family in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e,
                           self.request_prompt_tokens, self.request_generation_tokens, self.max_tokens,
                           self.preemptions, self.request_preemptions, self.iteration_tokens, self.params_n,
                           *self.phases.values()):
                family.labels(*labels)
            for reason in FinishReason:  # vLLM's finished_reason labels: stop, length, abort
                self.request_success.labels(*labels, reason)

    def observe_request(self, dp_rank: int, finish_reason: FinishReason, num_prompt_tokens: int, num_output_tokens: int,
                        ttft_s: float | None, inter_token_s: Sequence[float], e2e_s: float) -> None:
        """Record one finished request served by DP worker `dp_rank`."""
        labels = (self.model_name, str(dp_rank))
        self.prompt_tokens.labels(*labels).inc(num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(num_output_tokens)
        self.request_success.labels(*labels, finish_reason).inc()
        self.e2e.labels(*labels).observe(e2e_s)
        for gap_s in inter_token_s:
            self.itl.labels(*labels).observe(gap_s)
        if ttft_s is not None:
            self.ttft.labels(*labels).observe(ttft_s)
            if num_output_tokens > 1:
                self.tpot.labels(*labels).observe((e2e_s - ttft_s) / (num_output_tokens - 1))

    def observe_steps(self, reports: Sequence[StepsMsg]) -> None:
        """Each engine step's tokens (vLLM's iteration tokens: the prompt tokens it computed plus one for
        each request it decoded), per DP rank."""
        for report in reports:
            histogram = self.iteration_tokens.labels(self.model_name, str(report.dp_rank))
            for step in report.steps:
                histogram.observe(step.num_prefill_tokens + step.num_decode_seqs)

    def observe_n(self, dp_rank: int, n: int) -> None:
        """A request admitted with `n` choices (once per request, not per choice)."""
        self.params_n.labels(self.model_name, str(dp_rank)).observe(n)

    def observe_phases(self, dp_rank: int, queued_s: float | None, ttft_s: float | None, e2e_s: float,
                       num_prompt_tokens: int, num_output_tokens: int, max_tokens: int, num_preemptions: int) -> None:
        """A finished request's phases as vLLM splits them: queue (arrival until it first ran, the
        engine's clock), prefill (then until its first token), decode (first token to the last),
        inference (first run to the last token); its token counts, max_tokens and preemptions."""
        labels = (self.model_name, str(dp_rank))
        self.request_prompt_tokens.labels(*labels).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(num_output_tokens)
        self.max_tokens.labels(*labels).observe(max_tokens)
        self.preemptions.labels(*labels).inc(num_preemptions)
        self.request_preemptions.labels(*labels).observe(num_preemptions)
        if queued_s is None:
            return
        self.phases["queue"].labels(*labels).observe(queued_s)
        self.phases["inference"].labels(*labels).observe(max(e2e_s - queued_s, 0.0))
        if ttft_s is not None:
            self.phases["prefill"].labels(*labels).observe(max(ttft_s - queued_s, 0.0))
            self.phases["decode"].labels(*labels).observe(max(e2e_s - ttft_s, 0.0))
