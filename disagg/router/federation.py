"""The served model's engine families on the router's /metrics: at each scrape the router reads every
server's /metrics (both roles, at once, each within the health check's timeout) and adds their
`vllm:*` and `sglang:*` series up, so one scrape of the front door shows the cluster.

Series with the same name and labels (a DP rank's `engine` label, a reason, a bucket's `le`) are
summed over the servers: counters, histograms and the count gauges. Two are not sums: a gauge of a
fraction (`vllm:kv_cache_usage_perc`) is the mean over the servers that report that series, and the
info gauges (`*_info`: one server's config) are left out. `_created` timestamps are dropped. A
server that does not answer in time is left out of that scrape (`disagg_router_federation_failures`
counts it). Parsing and adding are pure (`sum_expositions`); `federate` does the reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

PREFIXES = ("vllm:", "sglang:")
MEAN_FAMILIES = frozenset({"vllm:kv_cache_usage_perc"})


def _kept(name: str) -> bool:
    return name.startswith(PREFIXES) and not name.endswith(("_info", "_created"))


def _format_value(value: float) -> str:
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: Iterable[tuple[str, str]]) -> str:
    pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + pairs + "}" if pairs else ""


def sum_expositions(texts: Iterable[str]) -> str:
    """The engine families of every text, added up as the module says, in the text format (families
    in the order first seen, samples in the order first seen)."""
    heads: dict[str, tuple[str, str]] = {}  # family name -> (type, help)
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}  # family -> sample key -> [sum, n]
    for text in texts:
        for family in text_string_to_metric_families(text):
            if not _kept(family.name):
                continue
            heads.setdefault(family.name, (family.type, family.documentation))
            samples = sums.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                total = samples.setdefault((sample.name, tuple(sorted(sample.labels.items()))), [0.0, 0])
                total[0] += sample.value
                total[1] += 1
    lines = []
    for name, (kind, doc) in heads.items():
        shown = name + "_total" if kind == "counter" else name  # as prometheus_client writes a counter
        lines += [f"# HELP {shown} {doc} (summed over the router's servers)", f"# TYPE {shown} {kind}"]
        for (sample_name, labels), (total, count) in sums[name].items():
            value = total / count if name in MEAN_FAMILIES else total
            lines.append(f"{sample_name}{_labels(labels)} {_format_value(value)}")
    return "\n".join(lines) + ("\n" if lines else "")


async def read_metrics(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """A server's /metrics text, or None when it does not answer 200 in time."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return await r.text() if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


async def federate(session: aiohttp.ClientSession, urls: Iterable[str], timeout_s: float) -> tuple[str, int]:
    """The summed engine families of the servers at `urls` (each read once), and how many did not answer."""
    unique = list(dict.fromkeys(urls))
    texts = await asyncio.gather(*(read_metrics(session, url, timeout_s) for url in unique))
    answered = [t for t in texts if t is not None]
    return sum_expositions(answered), len(unique) - len(answered)
