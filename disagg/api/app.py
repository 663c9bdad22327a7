"""create_app: the aiohttp application of one server (unified, prefill or decode).

Middlewares, outermost first: a clean log context per request, request counting (Prometheus),
errors as OpenAI-shaped JSON, then the optional API and admin key checks (disagg.api.auth).
"""

from __future__ import annotations

import asyncio
import ssl

from aiohttp import web

from disagg.api import (
    admin_routes,
    fault_routes,
    openai_routes,
    responses,
    sglang_routes,
    tokenize_routes,
    tokens_routes,
    utility_routes,
)
from disagg.api.auth import auth_middleware
from disagg.api.errors import errors_middleware
from disagg.api.logging import configure_logging, log_context_middleware
from disagg.api.metrics import ApiMetrics
from disagg.api.state import STATE, ApiState
from disagg.api.traces import ROLE_NAMES, tracing_middleware
from disagg.config import ServerConfig
from disagg.dp.protocol import EngineClient
from disagg.drain import CLOSE_TIMEOUT_S
from disagg.http_site import start_site
from disagg.tracing import open_tracing


def create_app(config: ServerConfig, engine: EngineClient, *, configure_logs: bool = True) -> web.Application:
    """The HTTP app serving `engine`. With `configure_logs`, structlog is set up for `config.log_format`."""
    if configure_logs:
        configure_logging(config.log_format)
    metrics = ApiMetrics(engine.worker_states, engine.model.name, engine.dp_size, engine.dispatch_stats,
                         engine.take_step_reports, engine.model.max_model_len, engine.model.cache_info,
                         lambda: engine.mode)
    middlewares = [log_context_middleware, metrics.middleware(), errors_middleware]
    keys = auth_middleware(config.api_key, config.admin_key)
    if keys is not None:
        middlewares.append(keys)
    tracing = open_tracing(config.otlp_traces_endpoint, f"disagg-{ROLE_NAMES[engine.mode]}")
    if tracing is not None:  # outermost: its span sees the answer's final status
        middlewares.insert(0, tracing_middleware(tracing, lambda: engine.mode))
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=middlewares)
    app[STATE] = ApiState(config, engine, metrics, tracing=tracing)
    if tracing is not None:
        app.on_cleanup.append(lambda _: asyncio.to_thread(tracing.close))  # the spans not sent yet go out
    for module in (openai_routes, responses, sglang_routes, tokens_routes, tokenize_routes, admin_routes, utility_routes,
                   fault_routes):
        module.add_routes(app)
    return app


async def start_server(app: web.Application, host: str, port: int,
                       ssl_context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (0: any free port), over HTTPS with `ssl_context`; returns the runner
    (`await runner.cleanup()`) and port.

    Handlers are cancelled when their client disconnects, so a non-streaming request whose client
    left is aborted on its worker too (streams notice on their next write either way). Handlers still
    running at `runner.cleanup()` get CLOSE_TIMEOUT_S (drain generate requests before that).
    """
    return await start_site(app, host, port, ssl_context, handler_cancellation=True, shutdown_timeout=CLOSE_TIMEOUT_S)
