"""structlog set-up shared by every process: console lines or JSON lines, stdlib logging routed in."""

from __future__ import annotations

import logging
import sys

import structlog


class _DropHttp2Probes(logging.Filter):
    """Routers probe servers with an HTTP/2 preface (gRPC detection); aiohttp answers 400 and would
    log a traceback per probe. The probe is expected: drop the noise, keep every other error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


def configure_logging(log_format: str = "console", level: int = logging.INFO) -> None:
    """Idempotent; call once per process (front, workers, router)."""
    renderer = structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=lambda *args: structlog.PrintLogger(sys.stderr),  # sys.stderr as of each line
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _DropHttp2Probes) for f in server_log.filters):
        server_log.addFilter(_DropHttp2Probes())
