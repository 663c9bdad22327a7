"""Run an HTTP server with its DP engine workers until Ctrl-C (`disagg unified`).

Layer 4 beside the CLI: it composes the front door (disagg.api) with the DP controller.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable

import structlog
from aiohttp import web

from disagg.api.app import create_app
from disagg.config import EngineConfig, ServerConfig
from disagg.dp.controller import DPController
from disagg.dp.worker import HandlerFactory

log = structlog.get_logger(__name__)


def say(line: str) -> None:
    """Progress and ready lines go to stdout, one per line, flushed (tests and humans read them)."""
    print(line, flush=True)


async def start_server(server: ServerConfig, engine: EngineConfig, handler_factory: HandlerFactory | None = None,
                       progress: Callable[[str], None] = say) -> tuple[DPController, web.AppRunner, int]:
    """Start workers, then the HTTP site; returns the controller, the runner and the bound port."""
    controller = DPController(server, engine, handler_factory)
    try:
        await controller.start(progress)
    except BaseException:
        await controller.close()
        raise
    runner = web.AppRunner(create_app(server, controller), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server.host, server.port)
    await site.start()
    port = runner.addresses[0][1]
    return controller, runner, port


async def serve_forever(server: ServerConfig, engine: EngineConfig, handler_factory: HandlerFactory | None = None) -> int:
    controller, runner, port = await start_server(server, engine, handler_factory)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = f"http://{server.host}:{port}"
    say(f"ready: {url} serving {controller.model.name} with dp_size={server.dp_size}")
    say(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{controller.model.name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")
    await stop.wait()
    say("shutting down")
    await runner.cleanup()
    await controller.close()
    return 0


def run(server: ServerConfig, engine: EngineConfig, handler_factory: HandlerFactory | None = None) -> int:
    try:
        return asyncio.run(serve_forever(server, engine, handler_factory))
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
