#!/bin/bash
# docs/benchmarks.md "Roles that follow the load", no prefill from the start: `disagg serve` (its
# defaults, the planner's interval so long it never acts, and FLAGS), its prefill switched to decode
# (POST /pd_role_switch), then the chat bench at RATE, so both servers prefill their own requests all
# along. From the repository root, on a quiet machine:
#
#     OUT=bench-out/no-prefill [FLAGS="..."] scripts/bench_no_prefill.sh RATE
set -u
rate=$1
OUT=${OUT:-bench-out/no-prefill}
mkdir -p "$OUT"
log="$OUT/no-prefill-$rate.log"
. "$(dirname "$0")/serve_up.sh"
# shellcheck disable=SC2086  # FLAGS are words
start_serve "$log" --planner auto --planner-interval-s 100000 ${FLAGS:-} || exit 1
prefill=$(curl -s "$url/workers" | .venv/bin/python -c "import sys, json; print(json.load(sys.stdin)['prefill'][0]['url'])")
curl -s -X POST "$prefill/pd_role_switch" -H 'Content-Type: application/json' -d '{"new_role": "decode"}'; echo
for _ in $(seq 30); do  # until the router lists it as a decode (30 s at most)
  curl -s "$url/workers" | .venv/bin/python -c "import sys, json; sys.exit(bool(json.load(sys.stdin)['prefill']))" \
    && break
  sleep 1
done
n=$(.venv/bin/python -c "print(max(12, round(16 * $rate)))")
.venv/bin/disagg bench serve --base-url "$url" --workload chat --num-conversations "$n" --turns-per-conversation 4 \
  --system-prompt-tokens 256 --user-tokens 32 128 --output-tokens 64 --think-time-s 1 --long-doc-prob 0.1 \
  --long-doc-tokens 1024 --request-rate "$rate" --seed 0 --goodput ttft:1500 tpot:60 \
  --label no-prefill --out "$OUT/no-prefill-$rate.json" > "$OUT/no-prefill-$rate.txt" 2>&1
kill -TERM -- "-$pid"; wait "$pid"
grep -E "goodput|turns good|^TTFT|^TPOT|^ITL" "$OUT/no-prefill-$rate.txt"
