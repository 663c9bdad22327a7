"""vLLM's per-engine families, read from the DP workers' states at scrape time: the gauges and the
prefix-cache counters (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`) with exact values."""

from prometheus_client import CollectorRegistry, generate_latest

from disagg.api.vllm_metrics import _VllmWorkerCollector
from disagg.dp.protocol import WorkerState


def test_prefix_cache_counters_per_engine():
    states = [WorkerState(0, True, True, 1, 0, 30, 40, 1, prefix_cache_queries=272, prefix_cache_hits=132),
              WorkerState(1, True, True, 0, 2, 40, 40, 0)]
    registry = CollectorRegistry()
    registry.register(_VllmWorkerCollector("smol", lambda: states))
    lines = [line for line in generate_latest(registry).decode().splitlines()
             if line.startswith("vllm:prefix_cache") or line.startswith("vllm:kv_cache_usage_perc{")]
    assert lines == [
        'vllm:kv_cache_usage_perc{engine="0",model_name="smol"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1",model_name="smol"} 0.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="smol"} 272.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="smol"} 0.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="smol"} 132.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="smol"} 0.0',
    ]
