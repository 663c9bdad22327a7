#!/bin/bash
# The servers table of docs/benchmarks.md: each server started in turn on this machine, driven by the
# same streaming client (`disagg bench engine --peers`), then stopped. Run on a quiet machine from the
# repository root, with the peers installed as docs/benchmarks.md says (PEERS: their folder).
#
#     PEERS=peers scripts/bench_servers.sh > servers.md
set -u
PEERS=${PEERS:-peers}
GGUF=$(.venv/bin/python -c "from disagg.engine.loader import resolve_model_path; print(resolve_model_path('smollm2-135m'))")
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT

measure() {  # $1: label, $2: URL
  .venv/bin/disagg bench engine --skip-engine --peers "$1=$2" --peer-sequential 8 --peer-streams 16 2>&1 | grep "^| $1 " | head -1
}
stop() {  # the process group of $1
  kill -TERM -- "-$1" 2>/dev/null; wait "$1" 2>/dev/null; sleep 3
}
ours() {  # $1: label, rest: `disagg unified` arguments
  local label=$1 url=""; shift
  setsid .venv/bin/disagg unified --port 0 "$@" > "$LOG" 2>&1 &
  local pid=$!
  for _ in $(seq 240); do
    sleep 1; url=$(grep -o "^ready: http://[0-9.:]*" "$LOG" | head -1 | cut -d' ' -f2); [ -n "$url" ] && break
  done
  if [ -n "$url" ]; then measure "$label" "$url"; else echo "| $label | did not start |"; fi
  stop $pid
}
peer() {  # $1: label, $2: port, rest: the server's command
  local label=$1 port=$2; shift 2
  setsid "$@" > "$LOG" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do sleep 2; curl -sf "127.0.0.1:$port/v1/models" > /dev/null && break; done
  if curl -sf "127.0.0.1:$port/v1/models" > /dev/null; then measure "$label" "http://127.0.0.1:$port"; else echo "| $label | did not start |"; fi
  stop $pid
}

.venv/bin/python -c "from disagg.bench.engine import machine_line; print(machine_line())"
# The peers' own builds: llama.cpp's instruction sets are fixed when it is built (docs/benchmarks.md's recipe)
if [ -x "$PEERS/llama/bin/python" ]; then
  INFO="import llama_cpp as l; print('llama.cpp', l.__version__, l.llama_print_system_info().decode())"
  "$PEERS/llama/bin/python" -c "$INFO" 2>/dev/null
fi
if [ -x "$PEERS/vllm/bin/python" ]; then
  "$PEERS/vllm/bin/python" -c "import vllm; print('vLLM', vllm.__version__)" 2>/dev/null | tail -1
fi
echo "| server | 1 stream: TTFT p50 (ms) | 1 stream: TPOT p50 (ms) | 16 streams: output tok/s | failed |"
echo "|---|---|---|---|---|"
ours "disagg-dp1-default" --dp-size 1
ours "disagg-dp1-default-4K-pages" --dp-size 1 --no-huge-pages
ours "disagg-dp1-gguf" --dp-size 1 --quantization gguf
ours "disagg-dp2-gguf" --dp-size 2 --quantization gguf
ours "disagg-dp1-fp32" --dp-size 1 --dtype float32
if [ -x "$PEERS/vllm/bin/python" ]; then
  [ -d "$PEERS/smollm2-hf" ] || .venv/bin/python scripts/hf_folder.py "$PEERS/smollm2-hf" > /dev/null
  VLLM=("$PEERS/vllm/bin/python" -m vllm.entrypoints.openai.api_server --model "$PEERS/smollm2-hf"
        --served-model-name smollm2-135m --dtype float32 --gpu-memory-utilization 0.2 --max-model-len 2048
        --host 127.0.0.1)
  peer "vllm-cpu-default" 8012 env HF_HUB_OFFLINE=1 "${VLLM[@]}" --port 8012
  peer "vllm-cpu-2threads" 8013 env HF_HUB_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 "${VLLM[@]}" --port 8013
fi
if [ -x "$PEERS/llama/bin/python" ]; then
  peer "llama.cpp" 8011 "$PEERS/llama/bin/python" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port 8011 \
    --n_threads 2 --n_ctx 4096
fi
