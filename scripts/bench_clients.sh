#!/bin/bash
# docs/benchmarks.md "Driven by outside clients": AIPerf and `vllm bench serve`, each from PyPI in a venv of
# its own, against `disagg serve` with its defaults and `disagg unified --dp-size 2`, with its defaults and
# with serve's limits, one server at a time, each client at every concurrency, then a table. From the
# repository root:
#
#     python3 -m venv peers/aiperf && peers/aiperf/bin/pip install aiperf
#     # peers/vllm: vLLM CPU as docs/benchmarks.md's recipe installs it (its `vllm bench serve`)
#     .venv/bin/python scripts/hf_folder.py peers/smollm2-hf    # the tokenizer the clients count tokens with
#     OUT=bench-out/clients scripts/bench_clients.sh
#
# (AIPerf takes the folder's path as its tokenizer; with HF_HUB_OFFLINE=1 it looks the path up as a hub
# repository and fails.) CLIENTS picks the clients (default: "aiperf vllm", those installed); CONCURRENCIES,
# REQUESTS, ISL and OSL the load; SERVERS the rows; SERVE_FLAGS are added to `disagg serve`'s command and
# SERVE_LABEL names its rows (default: serve). Both clients count a request good within a TTFT of 1.5 s and a
# TPOT of 60 ms.
set -u
PEERS=${PEERS:-peers}
TOKENIZER=${TOKENIZER:-$PEERS/smollm2-hf}
OUT=${OUT:-bench-out/clients}
CLIENTS=${CLIENTS:-"aiperf vllm"}
CONCURRENCIES=${CONCURRENCIES:-"4 8"}
REQUESTS=${REQUESTS:-32}
ISL=${ISL:-256}
OSL=${OSL:-64}
SERVERS=${SERVERS:-"serve unified unified-limits"}
SERVE_FLAGS=${SERVE_FLAGS:-}
SERVE_LABEL=${SERVE_LABEL:-serve}
mkdir -p "$OUT"
. "$(dirname "$0")/serve_up.sh"

aiperf() {  # $1: url, $2: concurrency, $3: output folder
  "$PEERS/aiperf/bin/aiperf" profile --model smollm2-135m --url "$1" --endpoint-type chat --streaming \
    --tokenizer "$TOKENIZER" --concurrency "$2" --request-count "$REQUESTS" --isl "$ISL" --osl "$OSL" \
    --extra-inputs ignore_eos:true --goodput "time_to_first_token:1500 inter_token_latency:60" \
    --artifact-dir "$3" --ui-type none
}
vllm() {  # $1: url, $2: concurrency, $3: output folder
  HF_HUB_OFFLINE=1 "$PEERS/vllm/bin/vllm" bench serve --backend openai-chat --base-url "$1" \
    --endpoint /v1/chat/completions --model smollm2-135m --tokenizer "$TOKENIZER" --dataset-name random \
    --random-input-len "$ISL" --random-output-len "$OSL" --num-prompts "$REQUESTS" --max-concurrency "$2" \
    --request-rate inf --ignore-eos --goodput ttft:1500 tpot:60 --percentile-metrics ttft,tpot,itl \
    --metric-percentiles 50,99 --save-result --result-dir "$3" --result-filename result.json --disable-tqdm
}
run() {  # $1: label, rest: the server's command
  local label=$1; shift
  start_server "$OUT/$label.log" "$@" || { echo "$label: did not start" >&2; return; }
  for client in $CLIENTS; do
    for c in $CONCURRENCIES; do
      "$client" "$url" "$c" "$OUT/$client/$label-c$c" > "$OUT/$client-$label-c$c.txt" 2>&1 ||
        echo "$client against $label at concurrency $c failed ($OUT/$client-$label-c$c.txt)" >&2
    done
  done
  stop_server "$pid"
}

for client in $CLIENTS; do
  case $client in
    aiperf) [ -x "$PEERS/aiperf/bin/aiperf" ] || { echo "no $PEERS/aiperf/bin/aiperf" >&2; exit 2; } ;;
    vllm) [ -x "$PEERS/vllm/bin/vllm" ] || { echo "no $PEERS/vllm/bin/vllm" >&2; exit 2; } ;;
    *) echo "unknown client $client (aiperf, vllm)" >&2; exit 2 ;;
  esac
done
.venv/bin/python -c "from disagg.bench.engine import machine_line; print(machine_line())" | tee "$OUT/machine.txt"
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
.venv/bin/python scripts/clients_table.py --dir "$OUT"
