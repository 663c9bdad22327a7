"""A server's spans (`--otlp-traces-endpoint`; disagg/tracing.py): one SERVER span per generate
request, the child of the caller's `traceparent` (our router's span, through `disagg serve`), named
after the server's role and route (`prefill /generate`, `decode /v1/completions`, `unified ...`).

When a request finishes, its span gets the request's figures and a child span per phase, over the
times the front and the worker measured:
- prefill: `bootstrap_wait` (arrival until the decode's destination was known), `prefill` (arrival
  until the prompt was computed) and `kv_transfer` (what the transfer added after both); attributes
  `prefill_duration_ms`, `kv_transfer_overhead_ms`, `bootstrap_wait_ms`, `kv_bytes`, and a link to the
  decode's span (`decode_traceparent`), whose context came with the room's TransferInfo on the control
  plane (push flow): the two halves meet even when no caller's context reached both;
- decode: `kv_wait` (arrival until its KV was admitted, or `queue` when it prefilled the request
  itself), `first_token` and `generation`; attributes `disaggregation_used`, `kv_wait_ms`,
  `true_ttft_ms`, `decode_duration_ms`, `kv_bytes`;
- unified: `queue`, `first_token`, `generation`.
Every span also carries `request_id`, `bootstrap_room`, `dp_rank`, the token counts and the finish reason.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from disagg.config import DisaggregationMode
from disagg.tracing import Tracing, current_span, wall_ns

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate", "/inference/v1/generate",
                            "/invocations", "/v1/responses"})
ROLE_NAMES = {DisaggregationMode.NULL: "unified", DisaggregationMode.PREFILL: "prefill",
              DisaggregationMode.DECODE: "decode"}


def tracing_middleware(tracing: Tracing, mode: Callable[[], DisaggregationMode]):
    """An aiohttp middleware: the span of each generate request, current while its handler runs (a
    stream's handler returns when the stream ended)."""

    @web.middleware
    async def trace(request: web.Request, handler) -> web.StreamResponse:
        if request.method != "POST" or request.path not in GENERATE_PATHS:
            return await handler(request)
        role = ROLE_NAMES[mode()]
        span = tracing.start(f"{role} {request.path}", request.headers, {"disagg.role": role, "http.route": request.path})
        return await tracing.answer_within(span, lambda: handler(request))
    return trace


def record_finished(tracing: Tracing, totals, mode: DisaggregationMode, bootstrap_room: int | None) -> None:
    """The finished request's attributes and phase spans on the current span (see the module)."""
    span = current_span()
    if span is None:
        return
    t = totals
    arrival, end = wall_ns(t.arrival_s), wall_ns(t.last_token_s if t.last_token_s is not None else t.arrival_s)
    first = None if t.first_token_s is None else wall_ns(t.first_token_s)
    span.set_attributes({k: v for k, v in {
        "request_id": t.request_id, "bootstrap_room": bootstrap_room, "dp_rank": t.dp_rank,
        "prompt_tokens": t.num_prompt_tokens, "completion_tokens": t.num_output_tokens,
        "cached_tokens": t.num_cached_tokens, "finish_reason": str(t.finish_reason)}.items() if v is not None})
    kv = t.kv
    if mode is DisaggregationMode.PREFILL and kv is not None:
        computed = arrival + int(kv.prefill_compute_s * 1e9)
        both = arrival + int(max(kv.prefill_compute_s, kv.bootstrap_wait_s) * 1e9)
        tracing.record(span, "bootstrap_wait", arrival, arrival + int(kv.bootstrap_wait_s * 1e9))
        tracing.record(span, "prefill", arrival, computed, {"prompt_tokens": t.num_prompt_tokens})
        tracing.record(span, "kv_transfer", both, both + int(kv.transfer_s * 1e9), {"kv_bytes": kv.kv_bytes})
        span.set_attributes({"prefill_duration_ms": kv.prefill_compute_s * 1e3, "kv_transfer_overhead_ms": kv.transfer_s * 1e3,
                             "bootstrap_wait_ms": kv.bootstrap_wait_s * 1e3, "kv_bytes": kv.kv_bytes})
        if kv.decode_traceparent:  # the decode's request, as its TransferInfo named it on the control plane
            tracing.link(span, kv.decode_traceparent)
            span.set_attribute("decode_traceparent", kv.decode_traceparent)
        return
    waited = kv.kv_wait_s if kv is not None else (t.queued_s or 0.0)
    tracing.record(span, "kv_wait" if kv is not None else "queue", arrival, arrival + int(waited * 1e9))
    if first is not None:
        tracing.record(span, "first_token", arrival, first)
        tracing.record(span, "generation", first, end, {"completion_tokens": t.num_output_tokens})
    if mode is DisaggregationMode.DECODE:
        span.set_attributes({k: v for k, v in {
            "disaggregation_used": kv is not None, "kv_wait_ms": None if kv is None else kv.kv_wait_s * 1e3,
            "kv_bytes": None if kv is None else kv.kv_bytes,
            "true_ttft_ms": None if first is None else (first - arrival) / 1e6,
            "decode_duration_ms": None if first is None else (end - first) / 1e6}.items() if v is not None})
