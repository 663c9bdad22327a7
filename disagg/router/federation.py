"""The served model's engine families on the router's /metrics: at each scrape the router reads every
server's /metrics (both roles, at once, each within the health check's timeout) and adds their
`vllm:*` and `sglang:*` series up, so one scrape of the front door shows the cluster.

Series with the same name and labels (a DP rank's `engine` label, a reason, a bucket's `le`) are
summed over the servers: counters, histograms and the count gauges. Two are not sums: a gauge of a
fraction (`vllm:kv_cache_usage_perc`) is the mean over the servers that report that series, and the
info gauges (`*_info`: one server's config) are left out. `_created` timestamps are dropped. A
server that does not answer in time is left out of that scrape (`disagg_router_federation_failures`
counts it). Parsing and adding are pure (`sum_expositions`); `federate` does the reads.

The texts are read here, not with prometheus_client's parser: it reads every family and every label
character by character, 19-21 ms for two servers' 54 KB on a 2-core host, all of it inside the router's
event loop, where every stream it relays waits meanwhile (AIPerf reads /metrics three times a second).
This reader reads only the families kept, a line at a time, with the parser's rules for family names,
escapes and untyped samples (tests/unit/test_federation_sum.py holds the two to the same sums).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Iterator

import aiohttp

PREFIXES = ("vllm:", "sglang:")
MEAN_FAMILIES = frozenset({"vllm:kv_cache_usage_perc"})


def _kept(name: str) -> bool:
    return name.startswith(PREFIXES) and not name.endswith(("_info", "_created"))


def _format_value(value: float) -> str:
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _help(doc: str) -> str:
    """A HELP text escaped as the text format wants it (a newline in it would end the line)."""
    return doc.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: Iterable[tuple[str, str]]) -> str:
    pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + pairs + "}" if pairs else ""


# The sample names of a family of each type, as prometheus_client's parser has them (the family's name
# alone for the others); a sample named otherwise is a family of its own, of unknown type.
_SUFFIXES = {"summary": ("_count", "_sum", ""), "histogram": ("_count", "_sum", "_bucket")}
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)")  # name, labels, value (a timestamp after)
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def _unescape(value: str, quotes: bool) -> str:
    """A label value's escapes (backslash, quote, newline) or a HELP text's (backslash, newline)."""
    def one(m: re.Match) -> str:
        c = m.group(1)
        return "\n" if c == "n" else c if c == "\\" or (quotes and c == '"') else m.group(0)
    return _ESCAPE.sub(one, value) if "\\" in value else value


Samples = list[tuple[str, tuple[tuple[str, str], ...], float]]  # (sample name, sorted labels, value)


def _built(name: str, kind: str, doc: str, samples: Samples) -> tuple[str, str, str, Samples]:
    """A family as prometheus_client's parser builds it: a counter's name without `_total`, its samples with it."""
    if kind == "counter":
        if name.endswith("_total"):
            name = name[:-6]
        else:
            samples = [(sample + "_total", labels, value) for sample, labels, value in samples]
    return name, kind, doc, samples


def read_kept(text: str) -> Iterator[tuple[str, str, str, Samples]]:
    """(family, type, help, samples) of each family in the text format, in order, as prometheus_client's
    parser reads them, except that a family not kept (`PREFIXES`) comes with no samples: they are skipped unread."""
    name, kind, doc, allowed, samples = "", "unknown", "", (), []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE"):
                continue
            if parts[2] != name:  # a new family
                if name:
                    yield _built(name, kind, doc, samples)
                name, kind, doc, allowed, samples = parts[2], "unknown", "", (parts[2],), []
            if parts[1] == "HELP":
                doc = _unescape(parts[3], quotes=False) if len(parts) == 4 else ""
            else:
                kind = parts[3] if len(parts) == 4 else "unknown"
                allowed = tuple(name + suffix for suffix in _SUFFIXES.get(kind, ("",)))
            continue
        if not line:
            continue
        kept_line = line.startswith(PREFIXES)
        if not kept_line and not name.startswith(PREFIXES):
            continue  # a sample of a family not kept: nothing to read, nothing it can end
        m = _SAMPLE.match(line)
        if m is None:
            continue
        sample, labels, value = m.groups()
        pairs = tuple(sorted((k, _unescape(v, quotes=True)) for k, v in _LABEL.findall(labels or "")))
        if sample in allowed:
            samples.append((sample, pairs, float(value)))
            continue
        if name:  # a sample of no family: the family before it ends, and it is one of its own
            yield _built(name, kind, doc, samples)
        name, kind, doc, allowed, samples = "", "unknown", "", (), []
        if kept_line:
            yield sample, "unknown", "", [(sample, pairs, float(value))]
    if name:
        yield _built(name, kind, doc, samples)


def sum_expositions(texts: Iterable[str]) -> str:
    """The engine families of every text, added up as the module says, in the text format (families
    in the order first seen, samples in the order first seen)."""
    heads: dict[str, tuple[str, str]] = {}  # family name -> (type, help)
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}  # family -> sample key -> [sum, n]
    for text in texts:
        for family, kind, doc, family_samples in read_kept(text):
            if not _kept(family):
                continue
            heads.setdefault(family, (kind, doc))
            family_sums = sums.setdefault(family, {})
            for sample, labels, value in family_samples:
                if not sample.endswith("_created"):
                    total = family_sums.setdefault((sample, labels), [0.0, 0])
                    total[0] += value
                    total[1] += 1
    lines = []
    for name, (kind, doc) in heads.items():
        shown = name + "_total" if kind == "counter" else name  # as prometheus_client writes a counter
        lines += [f"# HELP {shown} {_help(doc)} (summed over the router's servers)", f"# TYPE {shown} {kind}"]
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
