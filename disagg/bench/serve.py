"""`disagg bench serve`: load a server or router through streaming OpenAI `/v1/completions`.

Random token-id prompts arrive as a Poisson process (or all at once); `--workload chat` sends
multi-turn conversations to `/v1/chat/completions` instead (serve_chat.py). Each request streams its
tokens back, and the client records TTFT (send to first content chunk), ITL (gaps between chunks),
TPOT and E2E, like vLLM's benchmark_serving. Optionally scrapes the servers' Prometheus `/metrics`
before and after the run, to say how much of TTFT the KV transfer takes. A pure HTTP client: no torch.

    python -m disagg.bench.serve --base-url http://127.0.0.1:30000 --num-prompts 40 --request-rate 2 \
        --input-len 256 --output-len 32 --slo ttft:1000 tpot:100 --out r.json --plot r.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import numpy as np

from disagg.bench.chat_workload import add_chat_arguments
from disagg.bench.serve_stats import (
    SERVER_HISTOGRAM_KEYS,
    format_refusals,
    RequestResult,
    Slo,
    aggregate,
    histogram_deltas,
    parse_histogram_totals,
    parse_slo,
    per_request_arrays,
)

PROMPT_TOKEN_RANGE = (100, 1000)  # ids drawn from [100, 1000): ordinary tokens of any Llama vocab
ADMIN_TIMEOUT_S = 10.0  # /v1/models and /metrics


def random_prompts(num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """`num_prompts` lists of `input_len` token ids from a seeded RNG."""
    rng = np.random.default_rng(seed)
    return rng.integers(*PROMPT_TOKEN_RANGE, size=(num_prompts, input_len)).tolist()


def arrival_offsets_s(num_prompts: int, request_rate: float, seed: int) -> list[float]:
    """Send times from the start of the run: 0, then exponential gaps of mean 1/rate (a Poisson
    process); all 0 for an infinite rate. Its RNG stream is separate from the prompts'."""
    if math.isinf(request_rate):
        return [0.0] * num_prompts
    gaps = np.random.default_rng([seed, 1]).exponential(1.0 / request_rate, size=max(num_prompts - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num_prompts]


def completion_payload(model: str, prompt: list[int], output_len: int) -> dict:
    """The /v1/completions body: exactly `output_len` greedy tokens, streamed, with a usage chunk."""
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def read_event(result: RequestResult, event: dict) -> tuple[str | None, dict | None]:
    """Fold an error event into `result`; (the text of a content chunk, else None; the usage, if any).
    A chat chunk counts as content only when its delta carries text (not the role announcement)."""
    if "error" in event:
        error = event["error"]
        result.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
    choices = event.get("choices")
    if not choices:
        return None, event.get("usage")
    if "delta" in choices[0]:
        return (choices[0]["delta"] or {}).get("content") or None, event.get("usage")
    return choices[0].get("text") or "", event.get("usage")


def read_usage(result: RequestResult, usage: dict) -> int | None:
    """Prompt and cached tokens from the server's usage into `result`; its completion tokens."""
    if usage.get("prompt_tokens") is not None:
        result.num_prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        result.num_cached_tokens = details["cached_tokens"]
    return usage.get("completion_tokens")


async def send_request(session: aiohttp.ClientSession, url: str, payload: dict, start_s: float,
                       timeout_s: float, headers: dict[str, str] | None = None) -> RequestResult:
    """Stream one completion; failures (non-200, error event, timeout, no content) end up in the result."""
    result = RequestResult(start_s=start_s, num_prompt_tokens=len(payload.get("prompt", ())))
    sent = time.perf_counter()
    chunk_times_s: list[float] = []  # from `sent`, one per content chunk
    pieces: list[str] = []
    usage_tokens = None
    try:
        async with session.post(url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                result.status, result.e2e_s = resp.status, time.perf_counter() - sent  # when the refusal came
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                now_s = time.perf_counter() - sent
                text, usage = read_event(result, json.loads(line[5:]))
                if text is not None:
                    chunk_times_s.append(now_s)
                    pieces.append(text)
                tokens = read_usage(result, usage) if usage else None
                usage_tokens = tokens if tokens is not None else usage_tokens
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        return result
    result.text = "".join(pieces)
    return finish_result(result, time.perf_counter() - sent, chunk_times_s, usage_tokens)


def finish_result(result: RequestResult, e2e_s: float, chunk_times_s: list[float],
                  usage_tokens: int | None) -> RequestResult:
    """Timings from the content chunks' arrival times; output tokens from usage, else the chunk count."""
    result.e2e_s = e2e_s
    result.num_output_tokens = usage_tokens if usage_tokens is not None else len(chunk_times_s)
    if chunk_times_s:
        result.ttft_s = chunk_times_s[0]
        result.itl_s = [b - a for a, b in zip(chunk_times_s, chunk_times_s[1:])]
    elif not result.error:
        result.error = "stream ended without a content chunk"
    result.ok = not result.error
    return result


async def drive_load(session: aiohttp.ClientSession, url: str, payloads: list[dict], offsets_s: list[float],
                     max_concurrency: int | None, timeout_s: float) -> tuple[list[RequestResult], float]:
    """Send each payload at its offset (at most `max_concurrency` in flight); (results, duration_s)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(payload: dict, start_s: float) -> RequestResult:
        if limit is None:
            return await send_request(session, url, payload, start_s, timeout_s)
        async with limit:  # every request holding it has its own timeout, so this wait is bounded
            return await send_request(session, url, payload, time.perf_counter() - start, timeout_s)

    start = time.perf_counter()
    tasks = []
    for payload, offset_s in zip(payloads, offsets_s):
        await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
        tasks.append(asyncio.create_task(one(payload, time.perf_counter() - start)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


async def fetch_model(session: aiohttp.ClientSession, base_url: str) -> str:
    """The first model `/v1/models` lists."""
    async with session.get(f"{base_url}/v1/models", timeout=aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)) as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def scrape(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, dict | str]:
    """Per URL: the matching histogram totals, or the error text when the scrape failed."""
    totals: dict[str, dict | str] = {}
    for url in urls:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)) as resp:
                resp.raise_for_status()
                totals[url] = parse_histogram_totals(await resp.text())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            totals[url] = f"{type(exc).__name__}: {exc}"
    return totals


def server_report(before: dict[str, dict | str], after: dict[str, dict | str]) -> dict[str, dict | str]:
    """Per metrics URL: histogram deltas, or why there are none."""
    report: dict[str, dict | str] = {}
    for url, totals in after.items():
        prior = before.get(url, {})
        if isinstance(totals, str) or isinstance(prior, str):
            report[url] = f"not available: scrape failed ({totals if isinstance(totals, str) else prior})"
        elif not totals:
            report[url] = f"not available: no histogram named *{'*, *'.join(SERVER_HISTOGRAM_KEYS)}*"
        else:
            report[url] = histogram_deltas(prior, totals)
    return report


def random_load(args: argparse.Namespace, model: str) -> tuple[list[dict], Callable[..., Awaitable]]:
    """(warm-up payloads, the run) of random token-id prompts on /v1/completions; the run returns
    (results, duration_s, the workload's report part)."""
    prompts = random_prompts(args.num_prompts + args.num_warmups, args.input_len, args.seed)
    payloads = [completion_payload(model, p, args.output_len) for p in prompts]
    offsets_s = arrival_offsets_s(args.num_prompts, args.request_rate, args.seed)

    async def drive(session: aiohttp.ClientSession, url: str) -> tuple[list[RequestResult], float, dict]:
        results, duration_s = await drive_load(session, url, payloads[args.num_warmups:], offsets_s,
                                               args.max_concurrency, args.timeout_s)
        return results, duration_s, {}

    return payloads[: args.num_warmups], drive


CONFIG_KEYS = ("base_url", "workload", "request_rate", "output_len", "seed", "max_concurrency", "num_warmups")
WORKLOAD_CONFIG_KEYS = {
    "random": ("num_prompts", "input_len"),
    "chat": ("num_conversations", "turns_per_conversation", "system_prompt_tokens", "user_tokens",
             "think_time_s", "long_doc_prob", "long_doc_tokens"),
}


async def bench(args: argparse.Namespace) -> dict:
    """Warm up, scrape, run the load, scrape again; the whole report as one JSON-ready dict."""
    base_url = args.base_url.rstrip("/")
    chat = args.workload == "chat"
    url = f"{base_url}/v1/chat/completions" if chat else f"{base_url}/v1/completions"
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = args.model or await fetch_model(session, base_url)
        if chat:
            from disagg.bench.serve_chat import chat_load  # it builds on this module's client

            warmups, drive = chat_load(args, model)
        else:
            warmups, drive = random_load(args, model)
        for payload in warmups:  # first-use costs (connections, KV handshakes)
            warm = await send_request(session, url, payload, 0.0, args.timeout_s)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")
        before = await scrape(session, args.metrics_url)
        results, duration_s, workload_report = await drive(session, url)
        after = await scrape(session, args.metrics_url)
    config = {key: getattr(args, key) for key in (*CONFIG_KEYS, *WORKLOAD_CONFIG_KEYS[args.workload])}
    return {"label": args.label, "model": model, "config": {**config, "request_rate": str(args.request_rate)},
            **aggregate(results, duration_s, args.slo), **workload_report,
            "server_histograms": server_report(before, after), "per_request": per_request_arrays(results)}


def format_summary(report: dict) -> str:
    """The readable table printed after a run."""
    lines = [
        format_title(report),
        f"completed / failed:        {report['num_completed']} / {report['num_failed']}",
        *([f"first error:               {report['first_error']}"] if report["num_failed"] else []),
        *([f"failed by HTTP status:     {format_refusals(report['refusals'])}"] if report["refusals"]["by_status"] else []),
        f"duration:                  {report['duration_s']:.2f} s",
        f"output tokens:             {report['num_output_tokens']}",
        f"request throughput:        {report['request_throughput']:.2f} req/s",
        f"output token throughput:   {report['output_throughput']:.1f} tok/s",
        f"goodput ({Slo(**report['slo']).describe()}): {report['goodput']:.2f} req/s "
        f"({report['num_good']} of {report['num_requests']} requests)",
        f"{'latency (ms)':<12} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}",
    ]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        figures = report[metric]
        cells = ["-" if v is None else f"{v:.1f}" for v in figures.values()]
        lines.append(f"{metric.upper():<12} " + " ".join(f"{c:>9}" for c in cells))
    lines += format_turns(report)
    lines += format_server(report["server_histograms"], report["ttft"]["mean_ms"])
    return "\n".join(lines)


def format_title(report: dict) -> str:
    """The first line: label, model, server and the load."""
    cfg = report["config"]
    if cfg.get("workload") == "chat":
        load = (f"{cfg['num_conversations']} conversations x {cfg['turns_per_conversation']} turns, "
                f"{cfg['output_len']} out, rate {cfg['request_rate']} conv/s")
    else:
        load = (f"{cfg['num_prompts']} prompts, {cfg['input_len']} in / {cfg['output_len']} out, "
                f"rate {cfg['request_rate']} req/s")
    return f"== disagg bench serve: {report['label']} ({report['model']} at {cfg['base_url']}, {load}) =="


def format_turns(report: dict) -> list[str]:
    """The chat workload's lines: conversations completed, then TTFT and prefix-cache share per turn."""
    if "per_turn" not in report:
        return []
    lines = [f"conversations completed:   {report['num_conversations_completed']} of {report['num_conversations']}",
             f"turns good / sent / offered: {report['num_good']} / {report['num_requests']} / "
             f"{report['num_turns_offered']} (a failed turn ends its conversation: its later turns are not sent)",
             f"{'turn':<12} {'done':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'cached':>9}"]
    for row in report["per_turn"]:
        cells = [f"{row['num_completed']}/{row['num_requests']}",
                 *("-" if row[k] is None else f"{row[k]:.1f}" for k in ("ttft_p50_ms", "ttft_p99_ms")),
                 "-" if row["cached_share"] is None else f"{row['cached_share']:.1%}"]
        lines.append(f"{row['turn_index']:<12} " + " ".join(f"{c:>9}" for c in cells))
    return lines


def format_server(server: dict[str, dict | str], ttft_mean_ms: float | None) -> list[str]:
    """Lines for the server histograms: observations, mean and share of the mean TTFT."""
    lines = []
    for url, deltas in server.items():
        lines.append(f"server histograms over the run, {url}:")
        if isinstance(deltas, str):
            lines.append(f"  {deltas}")
            continue
        lines += [f"  {name}: {d['count']:.0f} observations, mean {format_mean(name, d['mean'], ttft_mean_ms)}"
                  for name, d in deltas.items()]
    return lines


def format_mean(name: str, mean: float | None, ttft_mean_ms: float | None) -> str:
    """A histogram's mean: seconds as ms with their share of the mean TTFT, other units as they are."""
    if mean is None:
        return "-"
    if not name.endswith("_seconds"):
        return f"{mean:.3g}"  # the unit is the end of the name, e.g. _gb_per_s
    share = f", {mean * 1000 / ttft_mean_ms:.1%} of mean TTFT" if ttft_mean_ms else ""
    return f"{mean * 1000:.2f} ms{share}"


class SloAction(argparse.Action):
    """Parses `--slo ttft:MS tpot:MS` into an Slo; a bad item is a usage error naming it."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            setattr(namespace, self.dest, parse_slo(values))
        except ValueError as exc:
            parser.error(str(exc))


def positive_rate(text: str) -> float:
    """A request rate: a positive number of requests/s, or `inf`."""
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `disagg bench serve`."""
    add = parser.add_argument
    add("--base-url", required=True, help="server or router speaking OpenAI /v1/completions (and chat)")
    add("--workload", choices=("random", "chat"), default="random",
        help="random: single-turn random token-id prompts on /v1/completions; chat: multi-turn "
             "conversations on /v1/chat/completions (options below)")
    add("--model", default=None, help="model name to send (default: the first of /v1/models)")
    add("--request-rate", type=positive_rate, default=float("inf"),
        help="Poisson arrivals in requests/s (chat: conversations/s); inf sends every one at once")
    add("--num-prompts", type=int, default=40, help="requests in the run")
    add("--input-len", type=int, default=256, help="prompt tokens per request (random ids)")
    add("--output-len", "--output-tokens", dest="output_len", type=int, default=32,
        help="generated tokens per request (max_tokens with ignore_eos)")
    add("--seed", type=int, default=0, help="seed of the prompts and of the arrival times")
    add("--slo", "--goodput", dest="slo", nargs="+", action=SloAction, default=Slo(), metavar="METRIC:MS",
        help="goodput counts requests meeting these: ttft:MS and/or tpot:MS")
    add("--max-concurrency", type=int, default=None,
        help="cap on requests (chat: conversations) in flight (default: none)")
    add("--timeout-s", type=float, default=300.0, help="deadline of each request")
    add("--num-warmups", type=int, default=1, help="requests sent one by one before the run, not counted")
    add("--metrics-url", action="append", default=[],
        help="Prometheus endpoint scraped before and after the run (repeatable)")
    add("--label", default="serve", help="name of this run in the output")
    add("--out", default=None, help="write the report (aggregates and per-request arrays) as JSON here")
    add("--plot", default=None, help="write TTFT/TPOT plots (PNG) here")
    add("--plot-with", action="append", default=[],
        help="JSON report of an earlier run to draw beside this one (repeatable)")
    add_chat_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the summary, write --out and --plot; 1 if no request completed."""
    try:
        report = asyncio.run(bench(args))
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, KeyError, IndexError, ValueError) as exc:
        print(f"disagg bench serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(format_summary(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        from disagg.bench.serve_plot import plot_reports

        others = []
        for path in args.plot_with:
            with open(path) as f:
                others.append(json.load(f))
        plot_reports([*others, report], args.plot)
    return 0 if report["num_completed"] else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m disagg.bench.serve ...`."""
    parser = argparse.ArgumentParser(prog="disagg bench serve", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
