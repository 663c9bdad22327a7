#!/bin/bash
# docs/benchmarks.md "Defaults that pay": the multi-turn chat load at each rate against `disagg serve`
# with its defaults (sized to this machine) and `disagg unified --dp-size 2`, with its defaults and with
# the flags of serve's limits (`--max-waiting-requests 4 --max-num-seqs 8 --ttft-objective-ms 1500`), one server
# at a time, then the table
# (scripts/chat_table.py) with KV moved per later turn. Run on a quiet machine from the repository root:
#
#     RATES="0.5 1 1.5 2" OUT=bench-out/defaults scripts/bench_chat_defaults.sh
#
# A rate R sends 16 x R conversations (at least 12) of 4 turns each (CONVS_PER_RATE=48: 48 x R, a
# run three times as long, where the load holds after the planner's first moves). SERVERS picks rows (default:
# "unified unified-limits serve"); SERVE_FLAGS are added to `disagg serve`'s command, SERVE_LABEL names
# its rows (default: serve), to measure a setting against the defaults in one run.
set -u
RATES=${RATES:-"0.5 1 1.5 2"}
OUT=${OUT:-bench-out/defaults}
SERVERS=${SERVERS:-"unified unified-limits serve"}
SERVE_FLAGS=${SERVE_FLAGS:-}
SERVE_LABEL=${SERVE_LABEL:-serve}
CONVS_PER_RATE=${CONVS_PER_RATE:-16}
WAITING=${WAITING:-4}  # unified-limits' --max-waiting-requests: serve's sized default on 2 cores
TTFT_OBJECTIVE_MS=${TTFT_OBJECTIVE_MS:-1500}  # and its --ttft-objective-ms: serve's (the planner's --ttft-slo-ms)
mkdir -p "$OUT"
. "$(dirname "$0")/serve_up.sh"

run() {  # $1: label, $2: rate, $3: log file, rest: the server's command
  local label=$1 rate=$2 log=$3; shift 3
  start_server "$log" "$@" || { echo "$label at $rate: did not start" >&2; return; }
  local n
  n=$(.venv/bin/python -c "print(max(12, round($CONVS_PER_RATE * $rate)))")
  .venv/bin/disagg bench serve --base-url "$url" --workload chat --num-conversations "$n" --turns-per-conversation 4 \
    --system-prompt-tokens 256 --user-tokens 32 128 --output-tokens 64 --think-time-s 1 --long-doc-prob 0.1 \
    --long-doc-tokens 1024 --request-rate "$rate" --seed 0 --goodput ttft:1500 tpot:60 \
    --label "$label" --out "$OUT/$label-$rate.json" > "$OUT/$label-$rate.txt" 2>&1
  stop_server "$pid"
}

.venv/bin/python -c "from disagg.bench.engine import machine_line; print(machine_line())" | tee "$OUT/machine.txt"
for rate in $RATES; do
  for server in $SERVERS; do
    case $server in
      unified) run unified "$rate" "$OUT/unified-$rate.log" .venv/bin/disagg unified --port 0 --dp-size 2 ;;
      unified-limits) run unified-limits "$rate" "$OUT/unified-limits-$rate.log" .venv/bin/disagg unified --port 0 \
        --dp-size 2 --max-waiting-requests "$WAITING" --max-num-seqs 8 --ttft-objective-ms "$TTFT_OBJECTIVE_MS" ;;
      # shellcheck disable=SC2086  # SERVE_FLAGS are words
      serve) run "$SERVE_LABEL" "$rate" "$OUT/$SERVE_LABEL-$rate.log" .venv/bin/disagg serve --port 0 --log-format json \
        $SERVE_FLAGS ;;
      *) echo "unknown server $server (unified, unified-limits, serve)" >&2; exit 2 ;;
    esac
  done
done
.venv/bin/python scripts/chat_table.py --dir "$OUT" --rates $RATES
