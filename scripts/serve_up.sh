# Sourced by the benchmark scripts: start_serve LOG [FLAGS...] starts `disagg serve --port 0 --log-format
# json FLAGS` in its own process group, logging to LOG, and waits up to 240 s for its ready line; it sets
# $pid and $url, or returns 1 (the server stopped) when none came.
start_serve() {
  local log=$1; shift
  setsid .venv/bin/disagg serve --port 0 --log-format json "$@" > "$log" 2>&1 &
  pid=$!
  url=""
  for _ in $(seq 240); do
    sleep 1; url=$(grep -o "^ready: http://[0-9.:]*" "$log" | head -1 | cut -d' ' -f2); [ -n "$url" ] && return 0
  done
  echo "serve did not start" >&2; kill -TERM -- "-$pid"; return 1
}
