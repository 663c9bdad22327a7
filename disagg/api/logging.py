"""Per-request log context (structlog); process set-up is disagg.logs.configure_logging.

Each aiohttp request runs in its own context, so values bound with `bind_request` stay with that
request's lines and never leak into another's.
"""

from __future__ import annotations

import structlog
from aiohttp import web

from disagg.logs import configure_logging

__all__ = ["bind_request", "configure_logging", "log_context_middleware"]


def bind_request(request_id: str, **fields: object) -> None:
    """Bind the request id (and any non-None field, e.g. bootstrap_room) to this request's log lines."""
    structlog.contextvars.bind_contextvars(
        request_id=request_id, **{k: v for k, v in fields.items() if v is not None}
    )


@web.middleware
async def log_context_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Start each request with a clean log context holding its method and path."""
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(method=request.method, path=request.path)
    return await handler(request)
