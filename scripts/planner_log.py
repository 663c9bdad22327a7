"""The planner's decisions in a `disagg serve --log-format json` log (our router's `planner decision`
lines), one line each: time from the first, action (C: confirmed), the interval's 429s, and per role
its servers, requests in flight, steps, mean step, prompt tokens, decoding requests a step and queue,
then the reason. docs/benchmarks.md reads the planner's moves with it:

    python scripts/planner_log.py bench-out/defaults/serve-1.log
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime


def role_said(role: dict) -> str:
    return (f"{role['servers']} if {role['in_flight']} st {role['steps']} x {role['step_ms']} ms pt "
            f"{role['prompt_tokens']} seqs {role['decode_seqs_a_step']} w {role['waiting']}")


def lines(path: str) -> list[str]:
    """The log's decisions as text lines (lines that are not JSON, or not decisions, are skipped)."""
    out, start = [], None
    with open(path, encoding="utf-8") as f:
        for raw in f:
            try:
                entry = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if not isinstance(entry, dict) or entry.get("event") != "planner decision" or "prefill" not in entry:
                continue
            at = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
            start = at if start is None else start
            mark = "C" if entry["confirmed"] else " "
            out.append(f"{at - start:6.1f} s  {entry['action']:<17} {mark} 429s {entry['rejected']} | P "
                       f"{role_said(entry['prefill'])} | D {role_said(entry['decode'])} | {entry['reason']}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args()
    for path in args.logs:
        print(f"== {path}")
        print("\n".join(lines(path)))


if __name__ == "__main__":
    main()
