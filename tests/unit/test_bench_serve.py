"""`disagg bench serve`: its pure figures (percentiles, goodput, SLO parsing, arrivals, Prometheus
deltas) with exact values, and the whole command against a fake streaming server on a real socket."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest
from aiohttp import web
from fake_openai import app_in_thread, models, stream_events

from disagg.bench import serve
from disagg.bench.serve_stats import (
    RequestResult,
    Slo,
    aggregate,
    histogram_deltas,
    meets_slo,
    parse_histogram_totals,
    parse_slo,
    summarize_ms,
)


def done(ttft_s: float, e2e_s: float, num_output_tokens: int, start_s: float = 0.0) -> RequestResult:
    return RequestResult(start_s=start_s, num_prompt_tokens=4, ok=True, ttft_s=ttft_s, e2e_s=e2e_s,
                         itl_s=[0.01] * (num_output_tokens - 1), num_output_tokens=num_output_tokens)


def failed(error: str) -> RequestResult:
    return RequestResult(start_s=0.0, num_prompt_tokens=4, error=error)


# --- percentiles, aggregates, goodput -------------------------------------------------------------


def test_summarize_ms_uses_linear_percentiles():
    assert summarize_ms([0.4, 0.1, 0.3, 0.2]) == pytest.approx(
        {"mean_ms": 250.0, "p50_ms": 250.0, "p90_ms": 370.0, "p99_ms": 397.0})
    assert summarize_ms([0.05]) == pytest.approx({"mean_ms": 50.0, "p50_ms": 50.0, "p90_ms": 50.0, "p99_ms": 50.0})
    assert summarize_ms([]) == {"mean_ms": None, "p50_ms": None, "p90_ms": None, "p99_ms": None}


def test_tpot_excludes_first_token_and_single_token_outputs():
    assert done(ttft_s=0.2, e2e_s=0.5, num_output_tokens=4).tpot_s == pytest.approx(0.1)
    assert done(ttft_s=0.2, e2e_s=0.2, num_output_tokens=1).tpot_s is None
    assert failed("HTTP 500: boom").tpot_s is None


def test_meets_slo_needs_both_limits():
    slo = Slo(ttft_ms=250, tpot_ms=125)
    assert meets_slo(done(0.25, 0.625, 4), slo)        # ttft 250 ms, tpot 125 ms: on the limits
    assert not meets_slo(done(0.2501, 0.5, 4), slo)    # ttft over
    assert not meets_slo(done(0.1, 0.5, 4), slo)       # tpot 133 ms over
    assert meets_slo(done(0.1, 0.1, 1), slo)           # one token: no TPOT to miss
    assert not meets_slo(failed("x"), Slo())
    assert meets_slo(done(5.0, 50.0, 4), Slo())         # no SLO: every success counts


def test_aggregate_counts_throughput_and_goodput():
    results = [done(0.1, 0.4, 4), done(0.5, 0.8, 4), failed("HTTP 503: busy"), done(0.2, 1.1, 4),
               failed("second")]
    agg = aggregate(results, duration_s=2.0, slo=Slo(ttft_ms=300, tpot_ms=200))
    assert {k: agg[k] for k in ("num_requests", "num_completed", "num_failed", "first_error", "num_good",
                                "num_prompt_tokens", "num_output_tokens")} == {
        "num_requests": 5, "num_completed": 3, "num_failed": 2, "first_error": "HTTP 503: busy",
        "num_good": 1, "num_prompt_tokens": 12, "num_output_tokens": 12}
    assert agg["request_throughput"] == pytest.approx(1.5)
    assert agg["output_throughput"] == pytest.approx(6.0)
    assert agg["goodput"] == pytest.approx(0.5)  # only the first: 2nd misses TTFT, 4th TPOT (300 ms)
    assert agg["ttft"] == pytest.approx({"mean_ms": 800 / 3, "p50_ms": 200.0, "p90_ms": 440.0, "p99_ms": 494.0})
    assert agg["tpot"]["p50_ms"] == pytest.approx(100.0)
    assert agg["itl"] == pytest.approx({"mean_ms": 10.0, "p50_ms": 10.0, "p90_ms": 10.0, "p99_ms": 10.0})
    assert agg["e2e"]["mean_ms"] == pytest.approx(766.6666667)
    assert agg["slo"] == {"ttft_ms": 300, "tpot_ms": 200}
    assert agg["refusals"] == {"by_status": {}, "answer": dict.fromkeys(("mean_ms", "p50_ms", "p90_ms", "p99_ms")),
                               "answer_max_ms": None}  # no failure above carries its status


def test_refusals_count_each_status_and_how_soon_it_came():
    refused = [RequestResult(start_s=0.0, num_prompt_tokens=4, error="HTTP 429: full", status=429, e2e_s=s)
               for s in (0.002, 0.004, 0.006)]
    refused.append(RequestResult(start_s=0.0, num_prompt_tokens=4, error="HTTP 503: gone", status=503, e2e_s=1.5))
    agg = aggregate([*refused, failed("TimeoutError")], duration_s=1.0, slo=Slo())
    assert agg["refusals"]["by_status"] == {"429": 3, "503": 1}
    assert agg["refusals"]["answer"]["p50_ms"] == pytest.approx(5.0)
    assert agg["refusals"]["answer_max_ms"] == pytest.approx(1500.0)
    assert serve.format_refusals(agg["refusals"]) == "429: 3, 503: 1 (answered in p50 5.0 ms, max 1500.0 ms)"


# --- SLO and rate arguments --------------------------------------------------------------------------


def test_parse_slo():
    assert parse_slo(["ttft:1000", "tpot:100"]) == Slo(ttft_ms=1000.0, tpot_ms=100.0)
    assert parse_slo(["tpot:12.5"]) == Slo(tpot_ms=12.5)
    assert parse_slo([]) == Slo()


@pytest.mark.parametrize("items, message", [
    (["ttft"], "SLO 'ttft': expected ttft:MS or tpot:MS"),
    (["e2e:100"], "SLO 'e2e:100': expected ttft:MS or tpot:MS"),
    (["ttft:fast"], "SLO 'ttft:fast': 'fast' is not a number of milliseconds"),
    (["tpot:0"], "SLO 'tpot:0': milliseconds must be positive and finite"),
    (["tpot:inf"], "SLO 'tpot:inf': milliseconds must be positive and finite"),
    (["ttft:1", "ttft:2"], "SLO 'ttft:2': ttft given twice"),
])
def test_parse_slo_errors(items, message):
    with pytest.raises(ValueError) as err:
        parse_slo(items)
    assert str(err.value) == message


def test_cli_rejects_bad_slo_and_rate(capsys):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://x", "--slo", "ttft:1000", "tpot:100"])
    assert (args.slo, args.request_rate, args.metrics_url) == (Slo(1000.0, 100.0), math.inf, [])
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--base-url", "http://x", "--slo", "ttft=5"])
    assert exit_info.value.code == 2
    assert "SLO 'ttft=5': expected ttft:MS or tpot:MS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--base-url", "http://x", "--request-rate", "0"])
    assert "request rate must be > 0 or inf, got 0" in capsys.readouterr().err


# --- workload ----------------------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_with_mean_gap_one_over_rate():
    offsets = serve.arrival_offsets_s(4000, request_rate=5.0, seed=7)
    assert offsets == serve.arrival_offsets_s(4000, request_rate=5.0, seed=7)
    assert offsets != serve.arrival_offsets_s(4000, request_rate=5.0, seed=8)
    assert offsets[0] == 0.0 and len(offsets) == 4000
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert min(gaps) >= 0.0
    assert sum(gaps) / len(gaps) == pytest.approx(0.2, rel=0.05)
    assert serve.arrival_offsets_s(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    assert serve.arrival_offsets_s(1, 2.0, seed=0) == [0.0]


def test_random_prompts_are_seeded_ids_in_range():
    prompts = serve.random_prompts(3, 50, seed=1)
    assert prompts == serve.random_prompts(3, 50, seed=1)
    assert [len(p) for p in prompts] == [50, 50, 50]
    assert all(100 <= t < 1000 and isinstance(t, int) for p in prompts for t in p)


def test_completion_payload():
    assert serve.completion_payload("m", [101, 102], 8) == {
        "model": "m", "prompt": [101, 102], "max_tokens": 8, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}


def test_finish_result_falls_back_to_chunk_count():
    result = serve.finish_result(RequestResult(0.0, 4), 0.5, [0.1, 0.15, 0.3], usage_tokens=None)
    assert (result.ok, result.num_output_tokens, result.ttft_s) == (True, 3, 0.1)
    assert result.itl_s == pytest.approx([0.05, 0.15])
    empty = serve.finish_result(RequestResult(0.0, 4), 0.5, [], usage_tokens=0)
    assert (empty.ok, empty.error) == (False, "stream ended without a content chunk")


# --- Prometheus deltas -------------------------------------------------------------------------------

PROM_BEFORE = """\
# HELP disagg_kv_transfer_seconds KV transfer time
# TYPE disagg_kv_transfer_seconds histogram
disagg_kv_transfer_seconds_bucket{dp_rank="0",le="0.01"} 1.0
disagg_kv_transfer_seconds_count{dp_rank="0"} 2.0
disagg_kv_transfer_seconds_sum{dp_rank="0"} 0.5
disagg_kv_transfer_seconds_count{dp_rank="1"} 1.0
disagg_kv_transfer_seconds_sum{dp_rank="1"} 0.25
disagg_kv_transfer_seconds_created{dp_rank="1"} 1.7e+09
disagg_time_to_first_token_seconds_sum 9.0
disagg_time_to_first_token_seconds_count 3.0
disagg_bootstrap_wait_seconds_count 0.0
disagg_bootstrap_wait_seconds_sum 0.0
"""
PROM_AFTER = PROM_BEFORE.replace('_count{dp_rank="1"} 1.0', '_count{dp_rank="1"} 5.0').replace(
    '_sum{dp_rank="1"} 0.25', '_sum{dp_rank="1"} 1.25') + "disagg_prefill_compute_seconds_sum 0.3\n" \
    "disagg_prefill_compute_seconds_count 2\n"


def test_parse_histogram_totals_sums_label_sets_of_matching_names():
    assert parse_histogram_totals(PROM_BEFORE) == {
        "disagg_kv_transfer_seconds": {"sum": 0.75, "count": 3.0},
        "disagg_bootstrap_wait_seconds": {"sum": 0.0, "count": 0.0},
    }
    assert parse_histogram_totals("# nothing here\n\n") == {}


def test_histogram_deltas():
    deltas = histogram_deltas(parse_histogram_totals(PROM_BEFORE), parse_histogram_totals(PROM_AFTER))
    assert list(deltas) == ["disagg_bootstrap_wait_seconds", "disagg_kv_transfer_seconds",
                            "disagg_prefill_compute_seconds"]
    assert deltas["disagg_bootstrap_wait_seconds"] == {"count": 0.0, "sum": 0.0, "mean": None}
    assert deltas["disagg_kv_transfer_seconds"] == {"count": 4.0, "sum": 1.0, "mean": 0.25}
    assert deltas["disagg_prefill_compute_seconds"] == pytest.approx({"count": 2.0, "sum": 0.3, "mean": 0.15})


def test_format_mean_gives_seconds_a_share_of_ttft():
    assert serve.format_mean("disagg_kv_transfer_seconds", 0.25, 1000.0) == "250.00 ms, 25.0% of mean TTFT"
    assert serve.format_mean("disagg_kv_transfer_seconds", 0.25, None) == "250.00 ms"
    assert serve.format_mean("disagg_kv_transfer_gb_per_s", 11.234, 1000.0) == "11.2"
    assert serve.format_mean("disagg_kv_wait_seconds", None, 1000.0) == "-"


def test_server_report_says_why_not_available():
    report = serve.server_report({"u1": {}, "u2": "ClientConnectorError: refused"},
                                 {"u1": {}, "u2": "ClientConnectorError: refused"})
    assert report == {
        "u1": "not available: no histogram named *kv_transfer*, *bootstrap_wait*, *prefill_compute*, *kv_wait*",
        "u2": "not available: scrape failed (ClientConnectorError: refused)",
    }


def test_bench_serve_imports_without_torch():
    code = "import sys, disagg.bench.serve, disagg.bench.serve_stats; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "False"), out.stderr


# --- the whole command against a fake server ---------------------------------------------------------


def fake_app() -> web.Application:
    """Request n (from 1, in arrival order): n%4==0 -> HTTP 503; n%4==2 -> an error event; n%4==1 ->
    4 content chunks and usage of 7 tokens; n%4==3 -> 3 content chunks and no usage chunk. /metrics
    counts one 2 ms `kv_transfer` observation per completion request."""
    served = [0]

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["ignore_eos"] and body["model"] == "fake-model"
        served[0] += 1
        n = served[0]
        if n % 4 == 0:
            return web.Response(status=503, text="busy")
        events = [{"error": {"message": f"engine died on {n}"}}] if n % 4 == 2 else \
            [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(4 if n % 4 == 1 else 3)]
        if n % 4 == 1:
            events.append({"choices": [], "usage": {"completion_tokens": 7}})
        return await stream_events(request, events)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f"disagg_kv_transfer_seconds_sum {served[0] * 0.002:.3f}\n"
                                 f"disagg_kv_transfer_seconds_count {served[0]}\n")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models),
                    web.get("/metrics", metrics)])
    return app


@pytest.fixture
def fake_server():
    """The fake app on 127.0.0.1, port 0, in its own thread and event loop; yields the base URL."""
    with app_in_thread(fake_app()) as base_url:
        yield base_url


@pytest.mark.timeout(30)
def test_command_against_fake_server(fake_server, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = serve.main(["--base-url", fake_server, "--num-prompts", "8", "--input-len", "16", "--output-len", "4",
                     "--max-concurrency", "1", "--num-warmups", "0", "--slo", "ttft:10000",
                     "--metrics-url", f"{fake_server}/metrics", "--label", "fake",
                     "--out", str(out), "--plot", str(png)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert (report["label"], report["model"]) == ("fake", "fake-model")
    assert (report["num_completed"], report["num_failed"], report["num_output_tokens"]) == (4, 4, 20)
    assert report["first_error"] == "engine died on 2"
    assert report["per_request"]["error"] == ["", "engine died on 2", "", "HTTP 503: busy",
                                            "", "engine died on 6", "", "HTTP 503: busy"]
    assert report["per_request"]["num_output_tokens"] == [7, 0, 3, 0] * 2
    assert [len(gaps) for gaps in report["per_request"]["itl_s"]] == [3, 0, 2, 0] * 2
    assert report["num_good"] == 4
    server = report["server_histograms"][f"{fake_server}/metrics"]
    assert list(server) == ["disagg_kv_transfer_seconds"]
    assert server["disagg_kv_transfer_seconds"] == pytest.approx({"count": 8.0, "sum": 0.016, "mean": 0.002})
    summary = capsys.readouterr().out
    assert "completed / failed:        4 / 4" in summary
    assert "first error:               engine died on 2" in summary
    assert "disagg_kv_transfer_seconds: 8 observations, mean 2.00 ms" in summary
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(30)
def test_command_fails_cleanly_without_server(capsys):
    rc = serve.main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])
    assert rc == 1
    assert capsys.readouterr().err.startswith("disagg bench serve: ClientConnectorError")
