"""vLLM's per-engine families, read from the DP workers' states at scrape time: the gauges, the
prefix-cache counters (`vllm:prefix_cache_queries`, `vllm:prefix_cache_hits`), the waiting requests by
reason and the cache config, with exact values."""

from prometheus_client import CollectorRegistry, generate_latest

from disagg.api.vllm_metrics import _VllmWorkerCollector
from disagg.dp.protocol import WorkerState
from disagg.engine_config import CacheConfig


def test_prefix_cache_counters_per_engine():
    states = [WorkerState(0, True, True, 1, 0, 30, 40, 1, prefix_cache_queries=272, prefix_cache_hits=132),
              WorkerState(1, True, True, 0, 2, 40, 40, 0)]
    registry = CollectorRegistry()
    registry.register(_VllmWorkerCollector("smol", lambda: states, {}))
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


def test_waiting_by_reason_and_the_cache_config():
    """A decode's requests whose KV is on its way wait "deferred"; those waiting for room, "capacity";
    vllm:num_requests_waiting is both, as vLLM counts its waiting queue."""
    states = [WorkerState(0, True, True, 1, 2, 30, 40, 4, num_waiting_deferred=3), WorkerState(1, True, True, 0, 0, 40, 40, 0)]
    info = CacheConfig(block_size=16, kv_cache_dtype="bfloat16").metrics_info(40)
    registry = CollectorRegistry()
    registry.register(_VllmWorkerCollector("smol", lambda: states, info))
    lines = [line for line in generate_latest(registry).decode().splitlines()
             if line.startswith(("vllm:num_requests_waiting", "vllm:cache_config_info", "# TYPE vllm:cache"))]
    assert lines == [
        'vllm:num_requests_waiting{engine="0",model_name="smol"} 5.0',
        'vllm:num_requests_waiting{engine="1",model_name="smol"} 0.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="smol",reason="capacity"} 2.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="smol",reason="deferred"} 3.0',
        'vllm:num_requests_waiting_by_reason{engine="1",model_name="smol",reason="capacity"} 0.0',
        'vllm:num_requests_waiting_by_reason{engine="1",model_name="smol",reason="deferred"} 0.0',
        '# TYPE vllm:cache_config_info gauge',
        'vllm:cache_config_info{block_size="16",cache_dtype="bfloat16",enable_prefix_caching="True",engine="0",'
        'kv_cache_memory_mib="512",num_cpu_blocks="None",num_gpu_blocks="40"} 1.0',
        'vllm:cache_config_info{block_size="16",cache_dtype="bfloat16",enable_prefix_caching="True",engine="1",'
        'kv_cache_memory_mib="512",num_cpu_blocks="None",num_gpu_blocks="40"} 1.0',
    ]
