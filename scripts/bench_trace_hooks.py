"""docs/api.md "Traces": what the router's tracing hooks cost a request, with tracing off (the
default: no span, one context-variable read per hook) and on (spans recorded; the exporter's
endpoint need not answer: export runs off the request's path, in the SDK's batch thread).

    .venv/bin/python scripts/bench_trace_hooks.py
"""

import timeit

from disagg import tracing
from disagg.bench.engine import machine_line
from disagg.router import traces


def request_hooks() -> None:
    """The hooks one P/D request passes in the router (proxy.py, traces.py)."""
    with tracing.step("router.pick"):
        pass
    with tracing.step("router.prefill_leg", {"server": "http://p"}):
        pass
    tracing.annotate(prefill_duration_ms=tracing.since_start_ms())
    traces.first_byte()
    tracing.annotate(disaggregation_used=True, reason="pd", bootstrap_room=1, prefill="http://p", decode="http://d",
                     retries=0)


def main() -> None:
    print(machine_line())
    n = 200_000
    off = min(timeit.repeat(request_hooks, number=n, repeat=5)) / n
    print(f"tracing off: {off * 1e6:.2f} us of hooks a request")
    tracer = tracing.Tracing("http://127.0.0.1:4318/v1/traces", "bench")
    span = tracer.start("router /v1/completions", {})

    def on() -> None:
        with tracer.activate(span):
            request_hooks()
    n = 20_000
    best = min(timeit.repeat(on, number=n, repeat=3)) / n
    print(f"tracing on: {best * 1e6:.2f} us of hooks a request (two child spans, six attributes)")


if __name__ == "__main__":
    main()
