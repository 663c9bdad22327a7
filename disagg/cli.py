"""`disagg` command line. The only place that exits the process."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg", description="Prefill/decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks (engine, transfer)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    add_bench_engine_args(bench_sub.add_parser("engine", help="engine prefill/decode tok/s beside HF transformers"))
    return parser


def add_bench_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2, help="best of N runs")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--out", default=None, help="write results as JSON here")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "engine":
        from disagg.bench import engine as bench_engine

        sys.exit(bench_engine.run(args))
    sys.exit(2)


if __name__ == "__main__":
    main()
