"""The table of docs/benchmarks.md "Defaults that pay" from scripts/bench_chat_defaults.sh's reports.

    python scripts/chat_table.py --dir bench-out/defaults --rates 0.5 1 1.5 2

Per rate, one row per server (`unified`, `unified-limits`, `serve`, and any `--labels` more, e.g. a
`SERVE_LABEL` run): good / sent / offered turns, goodput, TTFT p50 and p99, TPOT p99, ITL p99; the
goodput of serve (and of those labels) against the better unified run, serve's ITL p99 against the
plain unified run's (unified-limits' where the plain one did not run), and its KV moved per later
turn (scripts/kv_per_turn.py, the model's KV at `--bytes-per-token`, SmolLM2-135M in float32 by
default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from kv_per_turn import kv_per_turn  # noqa: E402

SERVERS = ("unified", "unified-limits", "serve")


def row(rate: str, label: str, r: dict, extra: str = "") -> str:
    return (f"| {rate}/s | {label} | {r['num_good']} / {r['num_requests']} / {r['num_turns_offered']} | "
            f"{r['goodput']:.2f} req/s{extra} | {r['ttft']['p50_ms']:.0f} ms | {r['ttft']['p99_ms']:.0f} ms | "
            f"{r['tpot']['p99_ms']:.1f} ms | {r['itl']['p99_ms']:.1f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rates", nargs="+", required=True)
    parser.add_argument("--bytes-per-token", type=int, default=46080)
    parser.add_argument("--labels", nargs="*", default=[], help="more runs' labels (bench_chat_defaults.sh's SERVE_LABEL)")
    args = parser.parse_args()
    print("| rate | server | good / sent / offered | goodput | TTFT p50 | TTFT p99 | TPOT p99 | ITL p99 |")
    print("|---|---|---|---|---|---|---|---|")
    notes = []
    for rate in args.rates:
        reports = {}
        for label in (*SERVERS, *args.labels):
            path = os.path.join(args.dir, f"{label}-{rate}.json")
            if os.path.exists(path):
                reports[label] = json.load(open(path))
        best = max((reports[u]["goodput"] for u in ("unified", "unified-limits") if u in reports), default=0.0)
        for label, r in reports.items():
            extra = f" ({r['goodput'] / best:.2f}x)" if not label.startswith("unified") and best else ""
            print(row(rate, label, r, extra))
        base = next((u for u in ("unified", "unified-limits") if u in reports), None)
        if "serve" in reports and base:
            itl = reports["serve"]["itl"]["p99_ms"] / reports[base]["itl"]["p99_ms"]
            k = kv_per_turn(os.path.join(args.dir, f"serve-{rate}.log"), os.path.join(args.dir, f"serve-{rate}.json"),
                            args.bytes_per_token)
            kv = ("no later turn moved KV" if not k["moved"] else
                  f"KV moved / new tokens' KV {k['total_all']:.2f}x over every later turn, {k['total_moved']:.2f}x "
                  f"(median {k['median_moved']:.2f}x) over the {k['moved']} that moved KV")
            notes.append(f"- {rate}/s: serve's ITL p99 {itl:.2f}x {base}'s; {k['later_turns']} later turns, "
                         f"{k['local']} prefilled by the decode; {kv}")
    print()
    print("\n".join(notes))


if __name__ == "__main__":
    main()
