"""The table of scripts/bench_clients.sh: one row per client, server and concurrency, in each client's own
figures: AIPerf's export (`aiperf/LABEL-cN/profile_export_aiperf.json`; its ITL is each request's mean gap
between tokens, TPOT) and `vllm bench serve`'s result (`vllm/LABEL-cN/result.json`).

    .venv/bin/python scripts/clients_table.py --dir bench-out/clients
"""
import argparse
import json
import re
from pathlib import Path


def cell(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def aiperf_row(path: Path) -> list[float | None]:
    export = json.loads(path.read_text())

    def stat(key: str, field: str) -> float | None:
        value = export.get(key)
        return value.get(field) if isinstance(value, dict) else None

    return [stat("request_count", "avg"), stat("error_request_count", "avg") or 0, stat("goodput", "avg"),
            stat("request_throughput", "avg"), stat("output_token_throughput", "avg"),
            stat("time_to_first_token", "p50"), stat("time_to_first_token", "p99"),
            stat("inter_token_latency", "p50"), stat("inter_token_latency", "p99")]


def vllm_row(path: Path) -> list[float | None]:
    result = json.loads(path.read_text())
    return [result.get("completed"), result.get("failed", 0), result.get("request_goodput"),
            result.get("request_throughput"), result.get("output_throughput"), result.get("p50_ttft_ms"),
            result.get("p99_ttft_ms"), result.get("p50_tpot_ms"), result.get("p99_tpot_ms")]


READERS = {"aiperf": ("profile_export_aiperf.json", aiperf_row), "vllm": ("result.json", vllm_row)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    print("| client | server | concurrency | requests ok / failed | goodput (req/s) | requests/s | output tok/s "
          "| TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for client, (name, read) in READERS.items():
        folder = Path(args.dir) / client
        found = folder.iterdir() if folder.is_dir() else []
        runs = [p for p in found if p.is_dir() and re.fullmatch(r".+-c\d+", p.name)]
        for run in sorted(runs, key=lambda p: (p.name.rsplit("-c", 1)[0], int(p.name.rsplit("-c", 1)[1]))):
            label, concurrency = run.name.rsplit("-c", 1)
            if not (run / name).exists():
                print(f"| {client} | {label} | {concurrency} | no result |")
                continue
            ok, failed, goodput, rps, tok_s, ttft50, ttft99, tpot50, tpot99 = read(run / name)
            print(f"| {client} | {label} | {concurrency} | {cell(ok)} / {cell(failed)} | {cell(goodput, 2)} "
                  f"| {cell(rps, 2)} | {cell(tok_s, 1)} | {cell(ttft50)} / {cell(ttft99)} "
                  f"| {cell(tpot50, 1)} / {cell(tpot99, 1)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
