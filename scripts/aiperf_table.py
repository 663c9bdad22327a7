"""The table of scripts/bench_aiperf.sh: one row per server and concurrency from AIPerf's own export
(`profile_export_aiperf.json` in each `LABEL-cN` folder), in AIPerf's figures.

    .venv/bin/python scripts/aiperf_table.py --dir bench-out/aiperf
"""
import argparse
import json
import re
from pathlib import Path


def stat(export: dict, key: str, field: str) -> float | None:
    value = export.get(key)
    return value.get(field) if isinstance(value, dict) else None


def cell(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    print("| server | concurrency | requests ok / errors | goodput (req/s) | request throughput (req/s) "
          "| output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    runs = [p for p in Path(args.dir).iterdir() if p.is_dir() and re.fullmatch(r".+-c\d+", p.name)]
    for folder in sorted(runs, key=lambda p: (p.name.rsplit("-c", 1)[0], int(p.name.rsplit("-c", 1)[1]))):
        path = folder / "profile_export_aiperf.json"
        if not path.exists():
            print(f"| {folder.name} | no export |")
            continue
        export = json.loads(path.read_text())
        label, concurrency = folder.name.rsplit("-c", 1)
        errors = stat(export, "error_request_count", "avg") or 0
        print(f"| {label} | {concurrency} | {cell(stat(export, 'request_count', 'avg'))} / {cell(errors)} "
              f"| {cell(stat(export, 'goodput', 'avg'), 2)} | {cell(stat(export, 'request_throughput', 'avg'), 2)} "
              f"| {cell(stat(export, 'output_token_throughput', 'avg'), 1)} "
              f"| {cell(stat(export, 'time_to_first_token', 'p50'))} / {cell(stat(export, 'time_to_first_token', 'p99'))} "
              f"| {cell(stat(export, 'inter_token_latency', 'p50'), 1)} / {cell(stat(export, 'inter_token_latency', 'p99'), 1)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
