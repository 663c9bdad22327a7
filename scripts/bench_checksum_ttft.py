"""What --kv-checksum costs a user: TTFT through `disagg serve` (its defaults, the default model) with
and without the flag, one cluster after the other, fresh prompts of each length (no prefix reuse),
alternating rounds. Prints the CPU flags, one row per prompt length and a markdown table.

    .venv/bin/python scripts/bench_checksum_ttft.py --tokens 512 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from disagg.ops.cpu import cpu_features


def start(port: int, checksum: bool) -> subprocess.Popen:
    args = [sys.executable, "-m", "disagg.cli", "serve", "--port", str(port), "--kv-checksum" if checksum else "--no-kv-checksum"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.startswith(f"ready: http://127.0.0.1:{port} "):  # the router's, after both servers'
            return proc
        if time.monotonic() > deadline:
            break
    raise RuntimeError("disagg serve did not start")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)


def ttft_ms(port: int, prompt: list[int]) -> float:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as resp:
        for raw in resp:
            if raw.startswith(b"data: {"):
                return (time.perf_counter() - started) * 1e3
    raise RuntimeError("no token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=30123)
    args = parser.parse_args()
    print(f"CPU: {cpu_features().describe()}", flush=True)
    times: dict[tuple[bool, int], list[float]] = {}
    seed = 1000
    for round_index in range(args.rounds):
        for checksum in ((False, True) if round_index % 2 == 0 else (True, False)):
            proc = start(args.port, checksum)
            try:
                for count in args.tokens:
                    seed += 1
                    prompt = [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(count)]  # no prefix shared
                    times.setdefault((checksum, count), []).append(ttft_ms(args.port, prompt))
                    print(f"round {round_index} checksum={checksum} tokens={count} ttft={times[(checksum, count)][-1]:.0f} ms",
                          flush=True)
            finally:
                stop(proc)
    print("\n| prompt tokens | TTFT p50 without | with `--kv-checksum` | with / without |\n|---|---|---|---|")
    for count in args.tokens:
        off, on = statistics.median(times[(False, count)]), statistics.median(times[(True, count)])
        print(f"| {count} | {off:.0f} ms | {on:.0f} ms | {on / off:.3f} |")


if __name__ == "__main__":
    main()
