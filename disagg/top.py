"""`disagg top URL`: a live view of a running cluster from its servers' /metrics.

URL is our router (its `/server_info` lists the prefill and decode servers) or one server. Each
refresh scrapes every server and prints one row per server and DP rank: requests running and
waiting, KV cache use, prefix-cache hit rate (vLLM's counters since the worker started), tokens
generated per second since the last refresh, TTFT and TPOT p50/p99 (from vLLM's histograms, as
Prometheus' histogram_quantile reads them: since the server started) and worker restarts. The
screen is redrawn in place; `--once` prints one snapshot and exits. Pure but for `targets`, `scrape` and `run`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[str, float]]  # metric sample name -> {DP rank -> value} (summed over other labels)
Histograms = dict[str, dict[str, list[tuple[float, float]]]]  # histogram -> {rank -> [(le, cumulative count)]}
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds")
COLUMNS = ("server", "role", "rank", "run", "wait", "kv%", "hit%", "tok/s", "ttft p50", "ttft p99", "tpot p50",
           "tpot p99", "restarts")


@dataclass
class Scrape:
    """One server's metrics at one time."""

    url: str
    role: str
    at: float
    samples: Samples
    histograms: Histograms


def parse(url: str, role: str, at: float, text: str) -> Scrape:
    """The per-rank samples of a /metrics text (rank: vLLM's `engine` or our `dp_rank` label)."""
    samples: Samples = defaultdict(lambda: defaultdict(float))
    histograms: Histograms = defaultdict(lambda: defaultdict(list))
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            rank = s.labels.get("engine", s.labels.get("dp_rank"))
            if rank is None:
                continue
            if family.name in HISTOGRAMS and s.name.endswith("_bucket"):
                histograms[family.name][rank].append((float(s.labels["le"]), s.value))
            else:
                samples[s.name][rank] += s.value
    return Scrape(url, role, at, samples, histograms)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets (linear within a bucket); None if empty."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower  # in the +Inf bucket: the highest finite bound, as Prometheus does
            return lower + (le - lower) * (rank - below) / (count - below) if count > below else le
        lower, below = le, count
    return lower


def rows(now: Scrape, before: Scrape | None) -> list[tuple[str, ...]]:
    """One table row per DP rank of one server."""
    s, out = now.samples, []
    for rank in sorted(s.get("vllm:num_requests_running", {}), key=int):
        def get(name: str) -> float:
            return s.get(name, {}).get(rank, 0.0)
        queries = get("vllm:prefix_cache_queries_total")
        hit = f"{100 * get('vllm:prefix_cache_hits_total') / queries:.0f}" if queries else "-"
        rate = "-"
        if before is not None and now.at > before.at:
            earlier = before.samples.get("vllm:generation_tokens_total", {}).get(rank, 0.0)
            rate = f"{(get('vllm:generation_tokens_total') - earlier) / (now.at - before.at):.1f}"
        latency = [_ms(quantile(q, now.histograms.get(h, {}).get(rank, []))) for h in HISTOGRAMS for q in (0.5, 0.99)]
        out.append((now.url, now.role, rank, f"{get('vllm:num_requests_running'):.0f}",
                    f"{get('vllm:num_requests_waiting'):.0f}", f"{100 * get('vllm:kv_cache_usage_perc'):.0f}", hit, rate,
                    *latency, f"{get('disagg_worker_restarts'):.0f}"))
    return out


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


def render(table: list[tuple[str, ...]]) -> str:
    """The rows as a fixed-width table under the column names."""
    lines = [COLUMNS, *table]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


async def targets(session: aiohttp.ClientSession, url: str) -> list[tuple[str, str]]:
    """(role, url) of every server behind `url`: a router's prefill and decode servers, or `url` itself."""
    async with session.get(url + "/server_info") as resp:
        info = await resp.json(content_type=None)
    if isinstance(info.get("prefill"), list) and isinstance(info.get("decode"), list):
        return [(role, server["url"]) for role in ("prefill", "decode") for server in info[role]]
    mode = info.get("disaggregation_mode") or "null"
    return [("unified" if mode == "null" else mode, url)]


async def scrape(session: aiohttp.ClientSession, role: str, url: str) -> Scrape:
    async with session.get(url + "/metrics") as resp:
        return parse(url, role, time.monotonic(), await resp.text())


async def run(url: str, interval_s: float, once: bool, out=sys.stdout) -> int:
    """Refresh until interrupted (or once); a server that does not answer is shown as such, and when
    `url` itself does not answer the servers it named last are still shown."""
    url = url.rstrip("/")
    before: dict[str, Scrape] = {}
    known: list[tuple[str, str]] = []
    timeout = aiohttp.ClientTimeout(total=max(interval_s, 2.0))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            note = ""
            try:
                known = await targets(session, url)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                note = f"{url}/server_info unreachable: {type(exc).__name__}\n"
                if once and not known:
                    out.write(note)
                    return 1
            table = []
            for role, server in known:
                try:
                    now = await scrape(session, role, server)
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    table.append((server, role, "-", f"unreachable: {type(exc).__name__}", *[""] * (len(COLUMNS) - 4)))
                    continue
                table += rows(now, before.get(server))
                before[server] = now
            screen = note + render(table)
            out.write(screen + "\n" if once else "\x1b[H\x1b[2J" + f"disagg top {url} (every {interval_s:g} s)\n" + screen + "\n")
            out.flush()
            if once:
                return 0
            await asyncio.sleep(interval_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="our router's URL (every server behind it) or one server's")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: 1)")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
