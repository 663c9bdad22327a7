"""The router's sum of its servers' engine families (disagg/router/federation.py): counters, histograms
and count gauges added by name and labels, the KV usage fraction averaged, info gauges and `_created`
left out, other families ignored; the result parses back with exact values."""

from prometheus_client.parser import text_string_to_metric_families

from disagg.router.federation import sum_expositions

PREFILL = '''# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 120.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 30.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# HELP vllm:e2e_request_latency_seconds e2e.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 4.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 3.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0"} 1.0
# HELP disagg_num_free_blocks free KV cache blocks
# TYPE disagg_num_free_blocks gauge
disagg_num_free_blocks{dp_rank="0"} 10.0
# HELP sglang:num_prefill_bootstrap_queue_reqs The number of requests in the prefill bootstrap queue.
# TYPE sglang:num_prefill_bootstrap_queue_reqs gauge
sglang:num_prefill_bootstrap_queue_reqs{dp_rank="0",engine_type="prefill",model_name="m",pp_rank="0",tp_rank="0"} 2.0
'''
DECODE = '''# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# HELP vllm:e2e_request_latency_seconds e2e.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 0.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 1.0
'''


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_families_add_up_over_the_servers():
    summed = sum_expositions([PREFILL, DECODE])
    m0, m1 = (("engine", "0"), ("model_name", "m")), (("engine", "1"), ("model_name", "m"))
    assert samples(summed) == {
        ("vllm:prompt_tokens_total", m0): 127.0,
        ("vllm:prompt_tokens_total", m1): 30.0,
        ("vllm:kv_cache_usage_perc", m0): 0.375,  # the mean of 0.5 and 0.25
        ("vllm:e2e_request_latency_seconds_bucket", (("engine", "0"), ("le", "1.0"), ("model_name", "m"))): 3.0,
        ("vllm:e2e_request_latency_seconds_bucket", (("engine", "0"), ("le", "+Inf"), ("model_name", "m"))): 4.0,
        ("vllm:e2e_request_latency_seconds_sum", m0): 5.0,
        ("vllm:e2e_request_latency_seconds_count", m0): 4.0,
        ("sglang:num_prefill_bootstrap_queue_reqs", (("dp_rank", "0"), ("engine_type", "prefill"), ("model_name", "m"),
                                                     ("pp_rank", "0"), ("tp_rank", "0"))): 2.0,
    }
    assert "# TYPE vllm:prompt_tokens_total counter" in summed.splitlines()
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in summed.splitlines()
    assert "created" not in summed and "info" not in summed and "disagg_" not in summed


def test_nothing_to_add():
    assert sum_expositions([]) == ""
    assert sum_expositions(["# TYPE disagg_x gauge\ndisagg_x 1.0\n"]) == ""
