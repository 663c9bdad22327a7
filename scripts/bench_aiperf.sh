#!/bin/bash
# docs/benchmarks.md "Driven by AIPerf": an outside client (AIPerf, from PyPI in a venv of its own) against
# `disagg serve` with its defaults and `disagg unified --dp-size 2`, with its defaults and with serve's limits,
# one server at a time, each at every concurrency, then a table. From the repository root:
#
#     python3 -m venv peers/aiperf && peers/aiperf/bin/pip install aiperf
#     .venv/bin/python scripts/hf_folder.py peers/smollm2-hf    # the tokenizer AIPerf counts tokens with
#     AIPERF=peers/aiperf/bin/aiperf TOKENIZER=peers/smollm2-hf OUT=bench-out/aiperf scripts/bench_aiperf.sh
#
# (AIPerf takes the folder's path as its tokenizer; with HF_HUB_OFFLINE=1 it looks the path up as a hub
# repository and fails.) CONCURRENCIES, REQUESTS, ISL and OSL pick the load; SERVERS the rows; SERVE_FLAGS
# are added to `disagg serve`'s command and SERVE_LABEL names its rows (default: serve).
set -u
AIPERF=${AIPERF:-peers/aiperf/bin/aiperf}
TOKENIZER=${TOKENIZER:-peers/smollm2-hf}
OUT=${OUT:-bench-out/aiperf}
CONCURRENCIES=${CONCURRENCIES:-"4 8"}
REQUESTS=${REQUESTS:-32}
ISL=${ISL:-256}
OSL=${OSL:-64}
SERVERS=${SERVERS:-"serve unified unified-limits"}
SERVE_FLAGS=${SERVE_FLAGS:-}
SERVE_LABEL=${SERVE_LABEL:-serve}
mkdir -p "$OUT"

stop() {  # the process group of $1
  kill -TERM -- "-$1" 2>/dev/null; wait "$1" 2>/dev/null; sleep 3
}
run() {  # $1: label, rest: the server's command
  local label=$1 url=""; shift
  setsid "$@" > "$OUT/$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 240); do
    sleep 1; url=$(grep -o "^ready: http://[0-9.:]*" "$OUT/$label.log" | head -1 | cut -d' ' -f2); [ -n "$url" ] && break
  done
  if [ -z "$url" ]; then echo "$label: did not start" >&2; stop $pid; return; fi
  for c in $CONCURRENCIES; do
    "$AIPERF" profile --model smollm2-135m --url "$url" --endpoint-type chat --streaming --tokenizer "$TOKENIZER" \
      --concurrency "$c" --request-count "$REQUESTS" --isl "$ISL" --osl "$OSL" --extra-inputs ignore_eos:true \
      --goodput "time_to_first_token:1500 inter_token_latency:60" --artifact-dir "$OUT/$label-c$c" --ui-type none \
      > "$OUT/$label-c$c.txt" 2>&1 || echo "$label at concurrency $c: aiperf failed ($OUT/$label-c$c.txt)" >&2
  done
  stop $pid
}

.venv/bin/python -c "from disagg.bench.engine import machine_line; print(machine_line())" | tee "$OUT/machine.txt"
"$AIPERF" --version 2>/dev/null | sed 's/^/aiperf /'
for server in $SERVERS; do
  case $server in
    # shellcheck disable=SC2086  # SERVE_FLAGS are words
    serve) run "$SERVE_LABEL" .venv/bin/disagg serve --port 0 $SERVE_FLAGS ;;
    unified) run unified .venv/bin/disagg unified --port 0 --dp-size 2 ;;
    unified-limits) run unified-limits .venv/bin/disagg unified --port 0 --dp-size 2 --max-waiting-requests 4 \
      --max-num-seqs 8 --ttft-objective-ms 1500 ;;
    *) echo "unknown server $server (serve, unified, unified-limits)" >&2; exit 2 ;;
  esac
done
.venv/bin/python scripts/aiperf_table.py --dir "$OUT"
