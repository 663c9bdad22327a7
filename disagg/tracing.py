"""OpenTelemetry traces (`--otlp-traces-endpoint`, vLLM's flag): one trace per request across our
router, the prefill and the decode, its W3C context carried in `traceparent` / `tracestate`.

The SDK and its OTLP/HTTP exporter (the `tracing` extra) load here, and only when tracing is on: with
it off no OpenTelemetry module is imported and a request pays one `is None` check. Spans go out in
batches (the SDK's BatchSpanProcessor; `OTEL_BSP_*` tune it, `OTEL_SERVICE_NAME` and
`OTEL_RESOURCE_ATTRIBUTES` name the service) to the endpoint as given, e.g.
`http://collector:4318/v1/traces`; `close()` sends what is left.

A phase measured elsewhere (a worker's queue, the KV wait, a transfer) becomes a child span with the
times it was measured at (`record`): spans need no clock of their own in the workers.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping

from disagg.config import ConfigError

# This request's (tracer, span), in its task and the tasks it starts (asyncio copies the context).
_CURRENT: contextvars.ContextVar[tuple[Tracing, object] | None] = contextvars.ContextVar("disagg_span", default=None)


def wall_ns(perf_s: float) -> int:
    """A `time.perf_counter()` reading as epoch nanoseconds (spans take wall-clock times)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


class Tracing:
    """One process's tracer for one service (`disagg-router`, `disagg-prefill`, ...)."""

    def __init__(self, endpoint: str, service_name: str):
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ConfigError(f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter: pip install "
                              f"'disagg[tracing]' ({exc})") from None
        self._trace = trace
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("disagg")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, name: str, headers: Mapping[str, str], attributes: dict | None = None):
        """A server span, the child of the caller's context in `headers` (a new trace without one)."""
        context = self._propagator.extract(carrier=headers)
        return self._tracer.start_span(name, context=context, kind=self._trace.SpanKind.SERVER,
                                       attributes=attributes or {})

    def inject(self, span, headers: MutableMapping[str, str]) -> None:
        """Set `traceparent` (and `tracestate`) in `headers` so that what they reach nests under `span`."""
        for name in ("traceparent", "tracestate"):
            headers.pop(name, None)
        self._propagator.inject(headers, context=self._trace.set_span_in_context(span))

    def link(self, span, traceparent: str) -> None:
        """Link `span` to the span a W3C `traceparent` names (another trace's, or this one's)."""
        other = self._trace.get_current_span(self._propagator.extract({"traceparent": traceparent})).get_span_context()
        if other.is_valid:
            span.add_link(other)

    def record(self, parent, name: str, start_ns: int, end_ns: int, attributes: dict | None = None) -> None:
        """A finished child span of `parent` over times measured elsewhere."""
        context = self._trace.set_span_in_context(parent)
        span = self._tracer.start_span(name, context=context, start_time=start_ns, attributes=attributes or {})
        span.end(end_time=max(end_ns, start_ns))

    @contextlib.contextmanager
    def activate(self, span) -> Iterator[None]:
        """`span` is the current request's span inside the block (`step`, `annotate` and
        `current_span` find it)."""
        token = _CURRENT.set((self, span))
        try:
            yield
        finally:
            _CURRENT.reset(token)

    async def answer_within(self, span, answer: Callable[[], Awaitable]):
        """`await answer()` with `span` current; the answer's HTTP status (or the status and message of
        the error it raised: an HttpError's) goes on the span, which then ends."""
        try:
            with self.activate(span):
                response = await answer()
            span.set_attribute("http.response.status_code", response.status)
            return response
        except Exception as exc:
            if isinstance(getattr(exc, "status", None), int):
                span.set_attributes({"http.response.status_code": exc.status,
                                     "error.message": str(getattr(exc, "message", exc))})
            raise
        finally:
            span.end()

    def close(self) -> None:
        """Export the spans not sent yet and stop."""
        self._provider.shutdown()


def open_tracing(endpoint: str | None, service_name: str) -> Tracing | None:
    """The process's tracer, or None when no endpoint is set (tracing off)."""
    return Tracing(endpoint, service_name) if endpoint else None


def current_span():
    """The current request's span; None when tracing is off."""
    current = _CURRENT.get()
    return None if current is None else current[1]


def current_traceparent() -> str:
    """The current request's span as a W3C `traceparent` ("" when tracing is off)."""
    span = current_span()
    if span is None:
        return ""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def annotate(**attributes) -> None:
    """Set attributes on the current request's span (nothing when tracing is off); None values are left out."""
    span = current_span()
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def since_start_ms() -> float | None:
    """Milliseconds since the current request's span started (None when tracing is off)."""
    span = current_span()
    return None if span is None else (time.time_ns() - span.start_time) / 1e6


_NOTHING = contextlib.nullcontext()


def step(name: str, attributes: dict | None = None) -> contextlib.AbstractContextManager:
    """A child span of the current request's span over the `with` block (nothing when tracing is off)."""
    current = _CURRENT.get()
    return _NOTHING if current is None else _step(current, name, attributes)


@contextlib.contextmanager
def _step(current: tuple[Tracing, object], name: str, attributes: dict | None) -> Iterator[None]:
    start = time.time_ns()
    try:
        yield
    finally:
        current[0].record(current[1], name, start, time.time_ns(), attributes)
