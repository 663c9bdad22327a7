"""`disagg top` on fixed /metrics texts: the rows, the histogram quantiles as Prometheus computes
them, the rate between two scrapes, and the rendered table, exactly."""

from disagg.top import parse, quantile, render, rows

DECODE_T0 = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 400.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 0.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 300.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 0.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="m"} 8.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 3.0
# TYPE vllm:request_time_per_output_token_seconds histogram
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="0.02",model_name="m"} 5.0
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="0.04",model_name="m"} 10.0
vllm:request_time_per_output_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:request_time_per_output_token_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_time_per_output_token_seconds_sum{engine="0",model_name="m"} 0.3
# TYPE disagg_worker_restarts gauge
disagg_worker_restarts{dp_rank="0"} 0.0
disagg_worker_restarts{dp_rank="1"} 2.0
"""


def test_quantiles_as_prometheus_computes_them():
    buckets = [(0.1, 2.0), (0.5, 8.0), (float("inf"), 10.0)]
    assert quantile(0.5, buckets) == 0.1 + 0.4 * (5 - 2) / (8 - 2)  # 0.3: within the (0.1, 0.5] bucket
    assert quantile(0.99, buckets) == 0.5  # in the +Inf bucket: the highest finite bound
    assert quantile(0.5, []) is None and quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_a_snapshot_of_two_ranks_and_the_rate_between_two_scrapes():
    before = parse("http://d:1", "decode", 10.0, DECODE_T0)
    now = parse("http://d:1", "decode", 12.0, DECODE_T0.replace("} 1000.0", "} 1050.0"))
    assert rows(now, None)[0][7] == "-"  # no earlier scrape: no rate yet
    table = rows(now, before)
    assert table == [
        ("http://d:1", "decode", "0", "3", "1", "25", "75", "25.0", "300 ms", "500 ms", "20 ms", "40 ms", "0"),
        ("http://d:1", "decode", "1", "0", "0", "0", "-", "0.0", "-", "-", "-", "-", "2"),
    ]
    assert render(table) == (
        "server      role    rank  run  wait  kv%  hit%  tok/s  ttft p50  ttft p99  tpot p50  tpot p99  restarts\n"
        "http://d:1  decode  0     3    1     25   75    25.0   300 ms    500 ms    20 ms     40 ms     0\n"
        "http://d:1  decode  1     0    0     0    -     0.0    -         -         -         -         2")
