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


def parser_sum(texts: list[str]) -> str:
    """sum_expositions as it was with prometheus_client's parser: the reference the router's own reader
    must equal, family for family and line for line."""
    from disagg.router.federation import MEAN_FAMILIES, _format_value, _help, _kept, _labels, _text_type
    heads, sums = {}, {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if not _kept(family.name):
                continue
            heads.setdefault(family.name, (family.type, family.documentation))
            family_sums = sums.setdefault(family.name, {})
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    total = family_sums.setdefault(
                        (sample.name, tuple(sorted(sample.labels.items()))), [0.0, 0])
                    total[0] += sample.value
                    total[1] += 1
    lines = []
    for name, (kind, doc) in heads.items():
        shown = name + "_total" if kind == "counter" else name
        lines += [f"# HELP {shown} {_help(doc)} (summed over the router's servers)",
                  f"# TYPE {shown} {_text_type(kind)}"]
        lines += [f"{s}{_labels(labels)} {_format_value(total / n if name in MEAN_FAMILIES else total)}"
                  for (s, labels), (total, n) in sums[name].items()]
    return "\n".join(lines) + ("\n" if lines else "")


class Untyped:
    """A collector of a family of unknown type (generate_latest writes `# TYPE ... untyped`)."""

    def collect(self):
        from prometheus_client.core import UnknownMetricFamily
        yield UnknownMetricFamily("vllm:untyped_family", "unknown", value=3.0)


def registry_text() -> str:
    """A server's exposition as prometheus_client writes it, with label values and help that need escapes."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
    registry = CollectorRegistry()
    tokens = Counter("vllm:prompt_tokens", 'prompt "tokens" \\ of\nrequests', ["model_name", "engine"],
                     registry=registry)
    tokens.labels('m "1"', "0").inc(5)
    tokens.labels("back\\slash, {brace}", "1").inc(2)
    tokens.labels("new\nline", "0").inc(1)
    Gauge("vllm:num_requests_running", "running", ["engine"], registry=registry).labels("0").set(3)
    latency = Histogram("vllm:e2e_request_latency_seconds", "e2e", ["engine"], buckets=(0.5, 2.0), registry=registry)
    for value in (0.1, 1.0, 9.0):
        latency.labels("0").observe(value)
    Summary("sglang:queue_time_seconds", "queue", registry=registry).observe(0.25)
    Histogram("vllm:kv_wait_seconds", "none yet", ["engine"], registry=registry)  # a family with no samples
    Gauge("vllm:odd_chars", "a\x0cform feed", ["model_name"], registry=registry).labels("a\rb\u2028c").set(1)
    registry.register(Untyped())
    Gauge("disagg_num_free_blocks", "free", registry=registry).set(7)
    return generate_latest(registry).decode()


ODD = '''# HELP vllm:a_total Counted, its TYPE line with _total.
# TYPE vllm:a_total counter
vllm:a_total{engine="0"} 2.0
# TYPE vllm:b counter
vllm:b{engine="0"} 3.0
# TYPE vllm:c gauge
vllm:c{engine="0"} 1.0 1700000000000
vllm:stray{engine="0"} 4.0
vllm:c{engine="1"} 5.0
# TYPE vllm:d gauge
vllm:d 1.5
disagg_stray 1.0
vllm:d 2.5

# HELP vllm:e Help with a \\\\ backslash and a \\n newline.
vllm:e{engine="0",} 6.0
# HELP disagg_x not ours
# TYPE disagg_x gauge
disagg_x 1.0
sglang:untyped 7.0
# TYPE vllm:spaced gauge
vllm:spaced {engine="0"} 1.0
vllm:spaced{engine="1"}2.0
# TYPE vllm:ended counter
vllm:ended 1.0
# HELP
vllm:ended 2.0
# TYPE vllm:colon gauge
vllm:colon{a:b="c"} 1.0
'''


def test_the_router_reads_as_prometheus_client_parses():
    texts = [registry_text(), registry_text(), PREFILL, DECODE, ODD]
    for chosen in ([PREFILL, DECODE], [registry_text()], [ODD], texts):
        assert sum_expositions(chosen) == parser_sum(chosen)
    text = sum_expositions([registry_text(), registry_text()])
    assert ("# HELP vllm:prompt_tokens_total prompt \"tokens\" \\\\ of\\nrequests (summed over the router's servers)"
            in text.splitlines())  # escaped again: a newline in it would end the line
    assert "# TYPE vllm:kv_wait_seconds histogram" in text.splitlines()
    assert "# TYPE vllm:untyped_family untyped" in text.split("\n")
    assert 'vllm:odd_chars{model_name="a\rb\u2028c"} 2.0' in text.split("\n")
    summed = samples(text)
    assert summed[("vllm:prompt_tokens_total", (("engine", "1"), ("model_name", "back\\slash, {brace}")))] == 4.0
    assert summed[("vllm:prompt_tokens_total", (("engine", "0"), ("model_name", "new\nline")))] == 2.0
    assert summed[("vllm:e2e_request_latency_seconds_bucket", (("engine", "0"), ("le", "2.0")))] == 4.0
    assert summed[("sglang:queue_time_seconds_count", ())] == 2.0
    odd = samples(sum_expositions([ODD]))
    assert odd == {("vllm:a_total", (("engine", "0"),)): 2.0, ("vllm:b_total", (("engine", "0"),)): 3.0,
                   ("vllm:c", (("engine", "0"),)): 1.0, ("vllm:stray", (("engine", "0"),)): 4.0,
                   ("vllm:c", (("engine", "1"),)): 5.0, ("vllm:d", ()): 4.0, ("vllm:e", (("engine", "0"),)): 6.0,
                   ("sglang:untyped", ()): 7.0, ("vllm:spaced", (("engine", "0"),)): 1.0,
                   ("vllm:spaced", (("engine", "1"),)): 2.0, ("vllm:ended_total", ()): 1.0, ("vllm:ended", ()): 2.0,
                   ("vllm:colon", (("a:b", "c"),)): 1.0}
    assert "# TYPE sglang:untyped untyped" in sum_expositions([ODD]).splitlines()  # "unknown" Prometheus refuses


def test_a_sample_that_is_no_number_is_left_out_not_a_failed_scrape():
    text = "# TYPE vllm:x gauge\nvllm:x{engine=\"0\"} abc\nvllm:x{engine=\"1\"} 2.0\n"
    assert sum_expositions([text]) == ("# HELP vllm:x  (summed over the router's servers)\n# TYPE vllm:x gauge\n"
                                       'vllm:x{engine="1"} 2.0\n')
