#!/bin/bash
# docs/benchmarks.md "Defaults that pay", the load step: one `disagg serve` with its defaults (and
# FLAGS), the chat load at 0.5, then 2.0, then 0.5 conversations/s one phase after the other, then each
# phase's goodput and the planner's decisions over time (scripts/load_step_table.py). From the
# repository root, on a quiet machine:
#
#     OUT=bench-out/step scripts/bench_load_step.sh [FLAGS...]
set -u
OUT=${OUT:-bench-out/step}
mkdir -p "$OUT"
log="$OUT/serve.log"
. "$(dirname "$0")/serve_up.sh"
start_serve "$log" "$@" || exit 1
phase=0
for spec in "0.5 12" "2 32" "0.5 12"; do
  set -- $spec
  phase=$((phase + 1))
  date -u +%s.%N > "$OUT/phase$phase.start"
  .venv/bin/disagg bench serve --base-url "$url" --workload chat --num-conversations "$2" --turns-per-conversation 4 \
    --system-prompt-tokens 256 --user-tokens 32 128 --output-tokens 64 --think-time-s 1 --long-doc-prob 0.1 \
    --long-doc-tokens 1024 --request-rate "$1" --seed "$phase" --goodput ttft:1500 tpot:60 \
    --label "phase$phase-$1" --out "$OUT/phase$phase.json" > "$OUT/phase$phase.txt" 2>&1
done
date -u +%s.%N > "$OUT/end"
kill -TERM -- "-$pid"; wait "$pid"
.venv/bin/python scripts/load_step_table.py --dir "$OUT"
