"""Servers side by side: `disagg bench engine --peers NAME=URL ...` drives each through one streaming client.

The peers (vLLM CPU, llama.cpp's server, our own `disagg unified` or `disagg serve`) are started by
the user (recipes in docs/benchmarks.md). Every server gets the same text prompts (~input_len
tokens; each server tokenizes them itself) on streaming `/v1/completions`: first one stream at a
time (TTFT and TPOT medians), then `--peer-streams` concurrent streams (output tok/s, failures).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from dataclasses import dataclass

import aiohttp

from disagg.bench.serve import drive_load, fetch_model, send_request
from disagg.bench.text import WORDS, num_words_for


@dataclass
class PeerResult:
    name: str
    url: str
    ttft_p50_ms: float
    tpot_p50_ms: float
    output_tok_s: float
    num_failed: int
    num_requests: int


def text_prompt(index: int, input_len: int) -> str:
    """A deterministic prompt of about `input_len` tokens, different for each index (no prefix-cache hits)."""
    rng = random.Random(index)
    return f"Story {index}: " + " ".join(rng.choice(WORDS) for _ in range(num_words_for(input_len)))


def payload(model: str, prompt: str, output_len: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def measure(name: str, base_url: str, input_len: int, output_len: int, num_sequential: int,
                  streams: int, timeout_s: float = 600.0) -> PeerResult:
    """One stream (num_sequential requests after a warm-up), then `streams` at once (2 x streams requests)."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = await fetch_model(session, base_url.rstrip("/"))
        await send_request(session, url, payload(model, text_prompt(10_000, input_len), output_len), 0.0, timeout_s)
        single = [await send_request(session, url, payload(model, text_prompt(i, input_len), output_len), 0.0, timeout_s)
                  for i in range(num_sequential)]
        batch = [payload(model, text_prompt(1000 + i, input_len), output_len) for i in range(2 * streams)]
        many, duration_s = await drive_load(session, url, batch, [0.0] * len(batch), streams, timeout_s)
    ok = [r for r in single if r.ok]
    ttfts = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]
    output = sum(r.num_output_tokens for r in many if r.ok)
    failed = sum(not r.ok for r in single + many)
    return PeerResult(name, base_url, _median(ttfts), _median(tpots), output / duration_s, failed,
                      len(single) + len(many))


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def peer_spec(spec: str) -> tuple[str, str]:
    """`NAME=URL` (an argparse type): (name, url); a malformed one is a usage error naming it."""
    name, sep, url = spec.partition("=")
    if not name or not sep or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"--peers takes NAME=http(s)://HOST:PORT, got {spec!r}")
    return name, url


def run_peers(peers: list[tuple[str, str]], input_len: int, output_len: int, num_sequential: int,
              streams: int) -> list[PeerResult]:
    """Measure each (name, url) in turn (never at the same time: they share the machine)."""
    results = []
    for name, url in peers:
        results.append(asyncio.run(measure(name, url, input_len, output_len, num_sequential, streams)))
        print(format_row(results[-1], streams), flush=True)
    return results


def format_table(results: list[PeerResult], streams: int) -> str:
    head = (f"| server | 1 stream: TTFT p50 (ms) | 1 stream: TPOT p50 (ms) | {streams} streams: output tok/s | failed |\n"
            "|---|---|---|---|---|")
    return "\n".join([head] + [format_row(r, streams) for r in results])


def format_row(r: PeerResult, streams: int) -> str:
    return (f"| {r.name} | {r.ttft_p50_ms:.0f} | {r.tpot_p50_ms:.1f} | {r.output_tok_s:.1f} | "
            f"{r.num_failed} of {r.num_requests} |")
