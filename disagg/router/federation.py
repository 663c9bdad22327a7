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
escapes and untyped samples: on the text format (0.0.4) it gives the same sums
(tests/unit/test_federation_sum.py holds the two to that). It is laxer on what that format forbids: a
sample it cannot read (a value that is no number, say) is left out instead of failing the scrape, and
OpenMetrics' exemplars and quoted names are not read. Types go out as the text format names them
(`untyped`, not `unknown`, which Prometheus's parser refuses).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

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


# The text format's names for the types prometheus_client reads (as its own exposition writes them).
_TEXT_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram"}


def _text_type(kind: str) -> str:
    return _TEXT_TYPES.get(kind, kind)


def _labels(labels: Iterable[tuple[str, str]]) -> str:
    pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + pairs + "}" if pairs else ""


# The sample names of a family of each type, as prometheus_client's parser has them (the family's name
# alone for the others); a sample named otherwise is a family of its own, of unknown type.
_SUFFIXES = {"summary": ("_count", "_sum", ""), "histogram": ("_count", "_sum", "_bucket")}
# name, labels (blanks around them allowed), value; a timestamp may follow
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:[ \t]*\{(.*)\}[ \t]*|[ \t]+)(\S+)")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")
Samples = list[tuple[str, tuple[tuple[str, str], ...], float]]  # (sample name, sorted labels, value)


def _unescape(value: str, quotes: bool) -> str:
    """A label value's escapes (backslash, quote, newline) or a HELP text's (backslash, newline)."""
    def one(m: re.Match) -> str:
        c = m.group(1)
        return "\n" if c == "n" else c if c == "\\" or (quotes and c == '"') else m.group(0)
    return _ESCAPE.sub(one, value) if "\\" in value else value


def _sample(m: re.Match) -> tuple[str, tuple[tuple[str, str], ...], float] | None:
    """A matched sample line's (name, sorted labels, value); None where its value is no number."""
    name, labels, value = m.groups()
    try:
        number = float(value)
    except ValueError:
        return None
    return name, tuple(sorted((k, _unescape(v, quotes=True)) for k, v in _LABEL.findall(labels or ""))), number


@dataclass
class _Family:
    """The family being read: its name as its HELP or TYPE line gives it, and the sample names it owns."""

    name: str = ""
    kind: str = "unknown"
    doc: str = ""
    allowed: tuple[str, ...] = ()
    samples: Samples = field(default_factory=list)

    def read(self) -> tuple[str, str, str, Samples]:
        """As prometheus_client's parser builds it: a counter's name without `_total`, its samples with it."""
        if self.kind != "counter":
            return self.name, self.kind, self.doc, self.samples
        if self.name.endswith("_total"):
            return self.name[:-6], self.kind, self.doc, self.samples
        return self.name, self.kind, self.doc, [(s + "_total", labels, v) for s, labels, v in self.samples]


def read_kept(text: str) -> Iterator[tuple[str, str, str, Samples]]:
    """(family, type, help, samples) of the families in the text format, in order, as prometheus_client's
    parser reads them, except that a family not kept (`PREFIXES`) comes with no samples (they are skipped
    unread) and a stray sample not kept is not yielded at all."""
    family = _Family()
    for line in text.split("\n"):  # not splitlines(): a label value may hold a \r or a form feed
        line = line.strip()
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) < 2 or parts[1] not in ("HELP", "TYPE"):
                continue
            name = parts[2] if len(parts) > 2 else ""
            if name != family.name:  # a new family (a bare `# HELP` ends the one before, as the parser has it)
                if family.name:
                    yield family.read()
                family = _Family(name, allowed=(name,))
            if parts[1] == "HELP":
                family.doc = _unescape(parts[3], quotes=False) if len(parts) == 4 else ""
            else:
                family.kind = parts[3] if len(parts) == 4 else "unknown"
                family.allowed = tuple(name + suffix for suffix in _SUFFIXES.get(family.kind, ("",)))
            continue
        kept_line = line.startswith(PREFIXES)
        if not line or (not kept_line and not family.name.startswith(PREFIXES)):
            continue  # blank, or a sample of a family not kept: nothing to read, nothing it can end
        m = _SAMPLE.match(line)
        sample = None if m is None else _sample(m)
        if sample is None:
            continue
        if sample[0] in family.allowed:
            family.samples.append(sample)
            continue
        if family.name:  # a sample of no family: the family before it ends, and it is one of its own
            yield family.read()
        family = _Family()
        if kept_line:
            yield sample[0], "unknown", "", [sample]
    if family.name:
        yield family.read()


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
        lines += [f"# HELP {shown} {_help(doc)} (summed over the router's servers)",
                  f"# TYPE {shown} {_text_type(kind)}"]
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
