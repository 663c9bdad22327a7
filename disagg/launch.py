"""Run one server (unified, prefill or decode) with its DP engine workers until SIGTERM or Ctrl-C.

Layer 4 beside the CLI: it composes the front door (disagg.api), the DP controller, and for the
P/D servers their workers' roles (PrefillRole, DecodeRole) and (prefill) the in-process bootstrap
registry. A stop signal drains the server (disagg.drain) before it closes; the registry closes
last, so the decodes of a prefill's last requests can still look it up.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import structlog
from aiohttp import web

from bootstrap.server import BootstrapServer
from disagg.api.app import create_app
from disagg.api.app import start_server as start_http
from disagg.api.state import STATE
from disagg.config import ConfigError, DisaggregationMode, LoadBalanceMethod, ServerConfig
from disagg.pd_config import DisaggConfig, check_cluster_secret
from disagg.cpus import usable_cpus, worker_cpu_sets
from disagg.registry_config import BootstrapConfig
from disagg.engine_config import EngineConfig
from disagg.kv_events_config import KVEventsConfig
from disagg.dp.controller import DPController
from disagg.worker.roles import RoleSpec, decode_role, prefill_role
from disagg.drain import Drain, StopSignals
from disagg.http_site import server_ssl_context
from kvtransfer.handshake import PROTOCOL_VERSION
from disagg.logs import configure_logging
from disagg.dp.prefill_front import PrefillController
from disagg.dp.role_switch import PdRoles

log = structlog.get_logger(__name__)


def say(line: str) -> None:
    """Progress and ready lines go to stdout, one per line, flushed (tests and humans read them)."""
    print(line, flush=True)


@dataclass
class RunningServer:
    """A started server. `await drain.run(timeout_s)` first to shut down gracefully, then `close()`."""

    controller: DPController
    runner: web.AppRunner
    port: int
    drain: Drain  # the front door's: refuses new requests and turns health red once it runs
    bootstrap: BootstrapServer | None = None

    @property
    def bootstrap_port(self) -> int | None:
        return None if self.bootstrap is None else self.bootstrap.port

    async def close(self) -> None:
        """Stop HTTP, then the workers, then the bootstrap registry."""
        await self.runner.cleanup()
        await self.controller.close()
        if self.bootstrap is not None:
            await self.bootstrap.close()


def _registry(disagg: DisaggConfig) -> BootstrapServer:
    own = disagg.prefill
    return BootstrapServer(BootstrapConfig(host=own.bootstrap_host, port=own.bootstrap_port,
                                           cluster_secret=disagg.cluster_secret,
                                           insecure_no_cluster_secret=disagg.insecure_no_cluster_secret))


def _role_specs(server: ServerConfig, disagg: DisaggConfig) -> PdRoles:
    """Both P/D roles of a server (the other one for a role switch) and each one's DP pick: a prefill
    follows the room (or the method it was started with), a decode balances load (likewise)."""
    mode = server.disaggregation_mode
    methods = {DisaggregationMode.PREFILL: LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM,
               DisaggregationMode.DECODE: LoadBalanceMethod.LEAST_LOAD, mode: server.load_balance_method}
    # /server_info's kv_compatibility: the engine's record (ModelCard.compatibility) and these
    transfer = {"kv_compatibility": {"transfer_backend": str(disagg.transfer_backend), "kv_protocol": PROTOCOL_VERSION,
                                     "kv_checksum": disagg.kv_checksum}}
    prefill = RoleSpec(prefill_role, dict(config=disagg, dp_size=server.dp_size,
                                          load_balance_method=methods[DisaggregationMode.PREFILL]), transfer)
    # Our router reads the local-prefill limit here (disagg/router/health.py): declared once, on the decode.
    decode = RoleSpec(decode_role, dict(config=disagg),
                      {"max_local_prefill_tokens": disagg.decode.max_local_prefill_tokens, **transfer})
    return PdRoles(mode, {DisaggregationMode.PREFILL: prefill, DisaggregationMode.DECODE: decode}, methods)


async def _controller(server: ServerConfig, engine: EngineConfig, disagg: DisaggConfig,
                      kv_events: KVEventsConfig) -> tuple[DPController, BootstrapServer | None]:
    """The front: a prefill's runs the bootstrap registry; so does one that may become a prefill."""
    mode = server.disaggregation_mode
    if mode is DisaggregationMode.NULL:
        return DPController(server, engine, kv_events=kv_events), None
    bootstrap = None
    if server.enable_pd_role_switch and disagg.prefill.external_registry:
        raise ConfigError("--enable-pd-role-switch needs the server's own bootstrap registry (a switch clears its "
                          "ranks there): drop --external-registry")
    if (mode is DisaggregationMode.PREFILL or server.enable_pd_role_switch) and not disagg.prefill.external_registry:
        bootstrap = _registry(disagg)
        disagg = replace(disagg, prefill=replace(disagg.prefill, bootstrap_port=await bootstrap.start()))
    roles = _role_specs(server, disagg)
    if server.enable_pd_role_switch:
        roles.bootstrap_port, roles.forget_ranks = disagg.prefill.bootstrap_port, bootstrap.registry.clear
        return PrefillController(server, engine, roles.spec, disagg, kv_events, roles), bootstrap
    if mode is DisaggregationMode.PREFILL:
        return PrefillController(server, engine, roles.spec, disagg, kv_events), bootstrap
    return DPController(server, engine, roles.spec, kv_events), None


async def start_server(server: ServerConfig, engine: EngineConfig, disagg: DisaggConfig = DisaggConfig(),
                       progress: Callable[[str], None] = say,
                       kv_events: KVEventsConfig = KVEventsConfig()) -> RunningServer:
    """Start (bootstrap,) workers, then the HTTP site; everything started is closed on failure. A
    prefill or decode open to the network without a cluster secret, or CPUs it may not use, are refused
    first (ConfigError)."""
    check_cluster_secret(server, disagg)
    worker_cpu_sets(server.cpus, server.dp_size, usable_cpus())  # a bad --cpus fails before anything starts
    if (engine.tensor_parallel_size > 1 and server.disaggregation_mode is not DisaggregationMode.NULL
            and engine.model.device != "cpu"):
        raise ConfigError("prefill and decode servers with tensor_parallel_size > 1 run on the CPU for now (a TP "
                          f"group moves its KV from one shared host region), not on {engine.model.device}")
    if disagg.insecure_no_cluster_secret and disagg.cluster_secret is None:
        log.warning("no cluster secret: the KV control plane, the KV listeners and the registry writes are open",
                    mode=server.disaggregation_mode)
    ssl_context = server_ssl_context(server.tls)  # a certificate that does not load stops us before the model
    controller, bootstrap = await _controller(server, engine, disagg, kv_events)
    try:
        await controller.start(progress)
        app = create_app(server, controller)
        runner, port = await start_http(app, server.host, server.port, ssl_context)
    except BaseException:
        await controller.close()
        if bootstrap is not None:
            await bootstrap.close()
        raise
    return RunningServer(controller, runner, port, app[STATE].drain, bootstrap)


async def serve_forever(server: ServerConfig, engine: EngineConfig, disagg: DisaggConfig,
                        kv_events: KVEventsConfig = KVEventsConfig()) -> int:
    running = await start_server(server, engine, disagg, kv_events=kv_events)
    signals = StopSignals()
    signals.install()
    url = f"{server.tls.scheme}://{server.host}:{running.port}"
    own = running.bootstrap is not None
    registry = disagg.prefill
    extra = (f" bootstrap_port={running.bootstrap_port}" if own else
             f" registry={registry.bootstrap_host}:{registry.bootstrap_port}" if registry.external_registry and
             server.disaggregation_mode is DisaggregationMode.PREFILL else "")
    card = running.controller.model
    extra += "" if server.cpus is None else f" cpus={server.cpus}"
    mode = "unified" if server.disaggregation_mode is DisaggregationMode.NULL else server.disaggregation_mode
    say(f"ready: {url} mode={mode} model={card.name} dp_size={server.dp_size}{extra}; {card.engine_summary}")
    if server.disaggregation_mode is DisaggregationMode.NULL:
        say(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
            f"-d '{{\"model\": \"{running.controller.model.name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'")
    await signals.requested.wait()
    say("shutting down")
    await drain_server(running, server.shutdown_timeout_s, signals.hurry)
    await running.close()
    return 0


async def drain_server(running: RunningServer, timeout_s: float, hurry: asyncio.Event | None = None) -> None:
    """Health red and new requests refused; in-flight requests get `timeout_s`, then are aborted; what
    is left of `timeout_s` goes to work the workers keep past their answers (a prefill's leases)."""
    mode = running.controller.server.disaggregation_mode
    log.info("draining", mode=mode, in_flight=running.drain.num_in_flight, shutdown_timeout_s=timeout_s)
    started = time.monotonic()
    aborted = await running.drain.run(timeout_s, hurry)
    left = await running.controller.settle(max(timeout_s - (time.monotonic() - started), 0.0), hurry)
    log.info("drained", mode=mode, aborted=aborted, leases_left=left)


def run(server: ServerConfig, engine: EngineConfig, disagg: DisaggConfig = DisaggConfig(),
        kv_events: KVEventsConfig = KVEventsConfig()) -> int:
    configure_logging(server.log_format)
    try:
        return asyncio.run(serve_forever(server, engine, disagg, kv_events))
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
