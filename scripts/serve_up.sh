# Sourced by the benchmark scripts.
# start_server LOG CMD...: runs CMD in its own process group, logging to LOG, and waits up to 240 s for its
# ready line; it sets $pid and $url, or stops it and returns 1 when none came.
# stop_server PID: stops that process group and waits for it.
# start_serve LOG [FLAGS...]: start_server with `disagg serve --port 0 --log-format json FLAGS`.
start_server() {
  local log=$1; shift
  setsid "$@" > "$log" 2>&1 &
  pid=$!
  url=""
  for _ in $(seq 240); do
    sleep 1; url=$(grep -o "^ready: http://[0-9.:]*" "$log" | head -1 | cut -d' ' -f2); [ -n "$url" ] && return 0
  done
  stop_server "$pid"; return 1
}
stop_server() {
  kill -TERM -- "-$1" 2>/dev/null; wait "$1" 2>/dev/null; sleep 3
}
start_serve() {
  local log=$1; shift
  start_server "$log" .venv/bin/disagg serve --port 0 --log-format json "$@" ||
    { echo "serve did not start" >&2; return 1; }
}
