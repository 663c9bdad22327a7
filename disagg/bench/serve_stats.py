"""The numbers of `disagg bench serve`: per-request timings, their aggregates, goodput under SLOs, and
the deltas of the servers' Prometheus histograms over the run.

Pure Python and numpy: no sockets, no asyncio, so every figure here is unit-tested with exact values.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
# Histograms (by substring of the name) whose means say where the time of a P/D request goes.
SERVER_HISTOGRAM_KEYS = ("kv_transfer", "bootstrap_wait", "prefill_compute", "kv_wait")
_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; None means no limit on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def describe(self) -> str:
        """`ttft<=1000ms, tpot<=100ms`, or `none`."""
        parts = [f"{name}<={ms:g}ms" for name, ms in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms))
                 if ms is not None]
        return ", ".join(parts) or "none"


@dataclass
class RequestResult:
    """What the client saw of one request. Times are seconds; `start_s` is from the start of the run."""

    start_s: float
    num_prompt_tokens: int
    ok: bool = False
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str = ""
    status: int | None = None  # the HTTP status of a request answered with an error (with e2e_s: when)
    text: str = ""  # the streamed answer (chat appends it to the history)
    num_cached_tokens: int | None = None  # the server's usage.prompt_tokens_details.cached_tokens
    conversation_id: int | None = None  # chat workload only
    turn_index: int | None = None  # chat workload only

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (output tokens - 1); None for failed requests and single-token outputs."""
        if not self.ok or self.num_output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def parse_slo(items: list[str]) -> Slo:
    """`["ttft:1000", "tpot:100"]` -> Slo(1000.0, 100.0). Raises ValueError naming the bad item."""
    limits: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot"):
            raise ValueError(f"SLO {item!r}: expected ttft:MS or tpot:MS")
        if name in limits:
            raise ValueError(f"SLO {item!r}: {name} given twice")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"SLO {item!r}: milliseconds must be positive and finite")
        limits[name] = ms
    return Slo(ttft_ms=limits.get("ttft"), tpot_ms=limits.get("tpot"))


def meets_slo(result: RequestResult, slo: Slo) -> bool:
    """A successful request within every given limit (a single-token output has no TPOT to miss)."""
    if not result.ok or result.ttft_s is None:
        return False
    if slo.ttft_ms is not None and result.ttft_s * 1000 > slo.ttft_ms:
        return False
    tpot_s = result.tpot_s
    return slo.tpot_ms is None or tpot_s is None or tpot_s * 1000 <= slo.tpot_ms


def summarize_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 (numpy's linear interpolation, as vLLM's benchmark) in ms; None if empty."""
    keys = ["mean_ms", *(f"p{p}_ms" for p in PERCENTILES)]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    figures = [float(ms.mean()), *(float(v) for v in np.percentile(ms, PERCENTILES))]
    return dict(zip(keys, figures))


def aggregate(results: list[RequestResult], duration_s: float, slo: Slo) -> dict:
    """Every aggregate figure of a run: counts, throughputs, goodput and latency summaries."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    num_output_tokens = sum(r.num_output_tokens for r in done)
    return {
        "num_requests": len(results),
        "num_completed": len(done),
        "num_failed": len(failed),
        "first_error": failed[0].error if failed else "",
        "duration_s": duration_s,
        "num_prompt_tokens": sum(r.num_prompt_tokens for r in done),
        "num_output_tokens": num_output_tokens,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": num_output_tokens / duration_s if duration_s > 0 else 0.0,
        "num_good": sum(meets_slo(r, slo) for r in results),
        "goodput": sum(meets_slo(r, slo) for r in results) / duration_s if duration_s > 0 else 0.0,
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "ttft": summarize_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot": summarize_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl": summarize_ms([gap for r in done for gap in r.itl_s]),
        "e2e": summarize_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "refusals": refusals(failed),
    }


def refusals(failed: list[RequestResult]) -> dict:
    """Requests answered with an HTTP error: how many per status, and how soon after they were sent
    (an overloaded server should refuse at once, not after a queue's deadline)."""
    answered = [r for r in failed if r.status is not None]
    by_status: dict[str, int] = {}
    for r in answered:
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    seconds = [r.e2e_s for r in answered if r.e2e_s is not None]
    return {"by_status": dict(sorted(by_status.items())), "answer": summarize_ms(seconds),
            "answer_max_ms": max(seconds) * 1000.0 if seconds else None}


def format_refusals(report: dict) -> str:
    """`429: 120, 503: 2 (answered in p50 3.1 ms, max 41.0 ms)`."""
    counts = ", ".join(f"{status}: {n}" for status, n in report["by_status"].items())
    return f"{counts} (answered in p50 {report['answer']['p50_ms']:.1f} ms, max {report['answer_max_ms']:.1f} ms)"


PER_REQUEST_FIELDS = ("start_s", "ok", "ttft_s", "tpot_s", "e2e_s", "itl_s", "num_prompt_tokens", "num_output_tokens",
                      "error", "status", "num_cached_tokens", "conversation_id", "turn_index")


def per_request_arrays(results: list[RequestResult]) -> dict[str, list]:
    """The raw per-request values, one list per field, in request order (None where not measured)."""
    return {name: [getattr(r, name) for r in results] for name in PER_REQUEST_FIELDS}


def per_turn(results: list[RequestResult]) -> list[dict]:
    """Per turn index: requests, completions, TTFT p50/p99 of the completed, and the prefix-cache share
    (cached / prompt tokens over the completed requests whose usage reported cached tokens; None if none did)."""
    rows = []
    for turn_index in sorted({r.turn_index for r in results if r.turn_index is not None}):
        of_turn = [r for r in results if r.turn_index == turn_index]
        done = [r for r in of_turn if r.ok]
        ttft = summarize_ms([r.ttft_s for r in done if r.ttft_s is not None])
        reported = [r for r in done if r.num_cached_tokens is not None]
        num_prompt = sum(r.num_prompt_tokens for r in reported)
        num_cached = sum(r.num_cached_tokens or 0 for r in reported)
        rows.append({"turn_index": turn_index, "num_requests": len(of_turn), "num_completed": len(done),
                     "ttft_p50_ms": ttft["p50_ms"], "ttft_p99_ms": ttft["p99_ms"],
                     "num_prompt_tokens": num_prompt, "num_cached_tokens": num_cached,
                     "cached_share": num_cached / num_prompt if reported and num_prompt else None})
    return rows


def parse_histogram_totals(text: str, keys: tuple[str, ...] = SERVER_HISTOGRAM_KEYS) -> dict[str, dict]:
    """Prometheus text -> {histogram name: {"sum": s, "count": n}} for names containing any of `keys`,
    summed over label sets (e.g. one per DP worker)."""
    totals: dict[str, dict] = {}
    for line in text.splitlines():
        match = _SAMPLE_LINE.match(line)
        if match is None:
            continue  # comments, blank lines
        name, value = match.group(1), match.group(3)
        for suffix in ("_sum", "_count"):
            base = name[: -len(suffix)]
            if name.endswith(suffix) and any(key in base for key in keys):
                entry = totals.setdefault(base, {"sum": 0.0, "count": 0.0})
                entry[suffix[1:]] += float(value)
    return totals


def histogram_deltas(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per histogram: the run's observations (count), their total (sum) and mean (None without
    observations), in the histogram's own unit, which its name ends with (`_seconds`, `_gb_per_s`).
    A histogram missing before the run counts from zero."""
    deltas = {}
    for name in sorted(after):
        prior = before.get(name, {"sum": 0.0, "count": 0.0})
        count = after[name]["count"] - prior["count"]
        total = after[name]["sum"] - prior["sum"]
        deltas[name] = {"count": count, "sum": total, "mean": total / count if count > 0 else None}
    return deltas
