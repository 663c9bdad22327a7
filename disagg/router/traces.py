"""The router's span of each generate request (`--otlp-traces-endpoint`; disagg/tracing.py): a SERVER
span named `router <path>`, the child of the client's `traceparent`, whose own context replaces the
client's on both legs, so the prefill's and the decode's spans nest under it in one trace.

Under it: `router.pick` (the pair and the room) and `router.prefill_leg` (until the prefill
answered). Its attributes, as llm-d's P/D proxy
names them where it has a name: `disaggregation_used` and `reason` (the answer's X-Disagg-Path and
why), `true_ttft_ms` (the decode's first bytes, as the client sees them; its whole answer, unstreamed), `prefill_duration_ms`
(the prefill leg), `decode_duration_ms` (first bytes to the end), plus `bootstrap_room`, the servers
and `retries`. The transfer's own time is on the prefill's span (`kv_transfer_overhead_ms`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from multidict import CIMultiDict

from disagg.tracing import Tracing, current_span

Serve = Callable[..., Awaitable[web.StreamResponse]]


async def traced(tracing: Tracing, request: web.Request, path: str, serve: Serve, raw: bytes | None = None
                 ) -> web.StreamResponse:
    """`serve(request, path)` inside the request's span; both legs get the span's context."""
    span = tracing.start(f"router {path}", request.headers, {"http.route": path})
    headers = CIMultiDict(request.headers)
    tracing.inject(span, headers)

    async def answer() -> web.StreamResponse:
        response = await serve(request.clone(headers=headers), path, raw)
        first_byte = span.attributes.get("true_ttft_ms")
        if first_byte is not None:
            span.set_attribute("decode_duration_ms", (span_age_ns(span) / 1e6) - first_byte)
        return response
    return await tracing.answer_within(span, answer)


def span_age_ns(span) -> int:
    return time.time_ns() - span.start_time


def first_byte() -> None:
    """The decode's first bytes reached the router: the request's true TTFT (once)."""
    span = current_span()
    if span is not None and "true_ttft_ms" not in span.attributes:
        span.set_attribute("true_ttft_ms", span_age_ns(span) / 1e6)
