"""Structured logs (structlog): console or JSON lines, each line bound to its request.

Each aiohttp request runs in its own context, so values bound with `bind_request` stay with that
request's lines and never leak into another's.
"""

from __future__ import annotations

import logging

import structlog
from aiohttp import web


def configure_logging(log_format: str, level: int = logging.INFO) -> None:
    """Set structlog up for this process: `json` writes one JSON object per line, `console` pretty text."""
    renderer = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        if log_format == "json" else [structlog.dev.ConsoleRenderer()]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(),
        cache_logger_on_first_use=False,
    )


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
