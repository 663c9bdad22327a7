"""Run one server (unified, prefill or decode) with its DP engine workers until Ctrl-C.

Layer 4 beside the CLI: it composes the front door (disagg.api), the DP controller, and for the
P/D roles their worker handlers and (prefill) the in-process bootstrap registry.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import structlog
from aiohttp import web

from bootstrap.server import BootstrapServer
from disagg.api.app import create_app
from disagg.api.app import start_server as start_http
from disagg.config import BootstrapConfig, DisaggConfig, EngineConfig, ServerConfig
from disagg.dp.controller import DPController
from disagg.dp.worker import HandlerSpec
from disagg.logs import configure_logging
from prefill.controller import PrefillController

log = structlog.get_logger(__name__)


def say(line: str) -> None:
    """Progress and ready lines go to stdout, one per line, flushed (tests and humans read them)."""
    print(line, flush=True)


@dataclass
class RunningServer:
    controller: DPController
    runner: web.AppRunner
    port: int
    bootstrap: BootstrapServer | None = None

    @property
    def bootstrap_port(self) -> int | None:
        return None if self.bootstrap is None else self.bootstrap.port

    async def close(self) -> None:
        await self.runner.cleanup()
        await self.controller.close()
        if self.bootstrap is not None:
            await self.bootstrap.close()


async def _controller(server: ServerConfig, engine: EngineConfig, disagg: DisaggConfig) -> tuple[DPController, BootstrapServer | None]:
    if server.disaggregation_mode == "prefill":
        bootstrap = BootstrapServer(BootstrapConfig(host=disagg.bootstrap_host, port=disagg.bootstrap_port,
                                                    cluster_secret=disagg.cluster_secret))
        disagg = replace(disagg, bootstrap_port=await bootstrap.start())
        handler = HandlerSpec("prefill.handler:PrefillHandler", dict(
            config=disagg, dp_size=server.dp_size, load_balance_method=server.load_balance_method))
        return PrefillController(server, engine, handler, disagg), bootstrap
    if server.disaggregation_mode == "decode":
        return DPController(server, engine, HandlerSpec("decode.handler:DecodeHandler", dict(config=disagg))), None
    return DPController(server, engine), None


async def start_server(server: ServerConfig, engine: EngineConfig, disagg: DisaggConfig = DisaggConfig(),
                       progress: Callable[[str], None] = say) -> RunningServer:
    """Start (bootstrap,) workers, then the HTTP site; everything started is closed on failure."""
    controller, bootstrap = await _controller(server, engine, disagg)
    try:
        await controller.start(progress)
        runner, port = await start_http(create_app(server, controller), server.host, server.port)
    except BaseException:
        await controller.close()
        if bootstrap is not None:
            await bootstrap.close()
        raise
    return RunningServer(controller, runner, port, bootstrap)


async def serve_forever(server: ServerConfig, engine: EngineConfig, disagg: DisaggConfig) -> int:
    running = await start_server(server, engine, disagg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    url = f"http://{server.host}:{running.port}"
    extra = f" bootstrap_port={running.bootstrap_port}" if running.bootstrap is not None else ""
    say(f"ready: {url} mode={server.disaggregation_mode} model={running.controller.model.name} dp_size={server.dp_size}{extra}")
    if server.disaggregation_mode == "null":
        say(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{running.controller.model.name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")
    await stop.wait()
    say("shutting down")
    await running.close()
    return 0


def run(server: ServerConfig, engine: EngineConfig, disagg: DisaggConfig = DisaggConfig()) -> int:
    configure_logging(server.log_format)
    try:
        return asyncio.run(serve_forever(server, engine, disagg))
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
