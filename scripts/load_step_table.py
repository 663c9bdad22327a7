"""scripts/bench_load_step.sh's tables: each phase's goodput, and the planner's decisions over time.

    python scripts/load_step_table.py --dir bench-out/step

The decisions come from the router's `planner decision` log lines (`disagg serve --log-format json`),
timed from the first phase's start; a run of decisions with the same action and the same reason but
for its numbers is one row, with its first reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re


def phases(folder: str) -> list[tuple[str, float, dict]]:
    out = []
    for i in (1, 2, 3):
        report = json.load(open(os.path.join(folder, f"phase{i}.json")))
        start = float(open(os.path.join(folder, f"phase{i}.start")).read())
        out.append((f"phase{i}", start, report))
    return out


def decisions(log_path: str, t0: float) -> list[tuple[float, str, str]]:
    rows = []
    for line in open(log_path, errors="replace"):
        start = line.find("{")
        try:
            event = json.loads(line[start:]) if start >= 0 else {}
        except json.JSONDecodeError:
            continue
        if event.get("event") == "planner decision":
            at = datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
            rows.append((at - t0, event["action"], event["reason"]))
    return rows


def same(a: tuple[float, str, str], b: tuple[float, str, str]) -> bool:
    """The same action and reason but for the numbers in it."""
    return a[1] == b[1] and re.sub(r"\d+", "#", a[2]) == re.sub(r"\d+", "#", b[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    runs = phases(args.dir)
    t0 = runs[0][1]
    print("| phase | rate | from | good / sent / offered | goodput | TTFT p50 | TPOT p99 | ITL p99 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, start, r in runs:
        print(f"| {name} | {r['config']['request_rate']}/s | {start - t0:.0f} s | {r['num_good']} / {r['num_requests']} / "
              f"{r['num_turns_offered']} | {r['goodput']:.2f} req/s | {r['ttft']['p50_ms']:.0f} ms | "
              f"{r['tpot']['p99_ms']:.1f} ms | {r['itl']['p99_ms']:.1f} ms |")
    print()
    print("| at | decisions | action | first reason |")
    print("|---|---|---|---|")
    rows = decisions(os.path.join(args.dir, "serve.log"), t0)
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and same(rows[j + 1], rows[i]):
            j += 1
        print(f"| {rows[i][0]:.0f}-{rows[j][0]:.0f} s | {j - i + 1} | {rows[i][1]} | {rows[i][2]} |")
        i = j + 1


if __name__ == "__main__":
    main()
