"""`disagg serve`: a whole local P/D cluster in one command, on 127.0.0.1.

Bootstrap registry (inside the prefill server), a prefill server and a decode server with
`dp_size` workers each, and the router in front. Servers behind the router use free ports; the
router listens on `--port`. SIGTERM or Ctrl-C drains the router first (its requests span both
servers), then prefill and decode within what is left of `--shutdown-timeout-s`, then stops them.

Every part gets the same cluster secret (a random one when none is given), so the control streams,
the KV listeners and the registry writes are authenticated; `api_key` guards the router and both
servers, `admin_key` the servers' admin routes; `tls` puts HTTPS on the router's port (the servers
behind it speak plain HTTP to it).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from dataclasses import replace

from disagg.config import SHUTDOWN_TIMEOUT_S, DisaggConfig, DisaggregationMode, LoadBalanceMethod, ServerConfig, TlsConfig
from disagg.tool_config import ToolConfig
from disagg.cpus import format_cpu_list, plan_cluster_cpus, usable_cpus
from disagg.engine_config import EngineConfig
from disagg.drain import StopSignals
from disagg.launch import RunningServer, drain_server, say, start_server
from disagg.logs import configure_logging
from disagg.router.config import CacheAwareConfig, PrefillEndpoint, RouterConfig
from disagg.router.policy import Policy
from disagg.router.server import RouterServer


def cpus_text(cpus: frozenset[int] | None) -> str | None:
    """A planned CPU set as ServerConfig.cpus takes it (None: not pinned)."""
    return None if cpus is None else format_cpu_list(cpus)


def cpus_note(prefill_cfg: ServerConfig, decode_cfg: ServerConfig) -> str:
    """`prefill on CPUs 0, decode on CPUs 1` for the progress and ready lines."""
    return ", ".join(f"{role} on CPUs {cfg.cpus or 'any'}" for role, cfg in (("prefill", prefill_cfg), ("decode", decode_cfg)))


def router_config(prefill: RunningServer, decode: RunningServer, cache_aware: CacheAwareConfig,
                  **settings) -> RouterConfig:
    """The router in front: cache_aware, so a shared prefix goes to the prefill rank that holds it, and
    a short rest to the decode alone when the decode prefills locally (`cache_aware`'s
    --max-local-prefill-tokens, the decode's too) and the prefill is busy enough
    (--local-prefill-min-prefill-load)."""
    host = settings["host"]
    return RouterConfig(
        policy=Policy.CACHE_AWARE, cache_aware=cache_aware,
        prefill=(PrefillEndpoint(f"http://{host}:{prefill.port}", prefill.bootstrap_port),),
        decode=(f"http://{host}:{decode.port}",), **settings)


async def start_cluster(engine: EngineConfig, disagg: DisaggConfig, *, host: str = "127.0.0.1", port: int = 30000,
                        dp_size: int = 2, log_format: str = "console", api_key: str | None = None,
                        admin_key: str | None = None, tls: TlsConfig = TlsConfig(), prefill_cpus: str | None = None,
                        decode_cpus: str | None = None, decode_engine: EngineConfig | None = None,
                        tools: ToolConfig = ToolConfig(),
                        cache_aware: CacheAwareConfig | None = None) -> tuple[RunningServer, RunningServer, RouterServer]:
    """Start the cluster. Prefill and decode each get their own CPUs (`plan_cluster_cpus`: by default
    the first and the second half of the usable ones); the router and the registry are not pinned.
    `decode_engine` is the decode's engine when it differs (its step budget), else `engine`;
    `cache_aware` the router's pick (default: the decode's --max-local-prefill-tokens, nothing else set)."""
    if disagg.cluster_secret is None:  # one local cluster: a fresh secret nobody else holds
        disagg = replace(disagg, cluster_secret=secrets.token_hex(32))
    planned = plan_cluster_cpus(usable_cpus(), prefill_cpus, decode_cpus)
    base = ServerConfig(host=host, port=0, dp_size=dp_size, log_format=log_format, api_key=api_key, admin_key=admin_key,
                        tools=tools)
    prefill_cfg = replace(base, disaggregation_mode=DisaggregationMode.PREFILL, cpus=cpus_text(planned[0]),
                          load_balance_method=LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM)
    # A conversation's later turns go back to the decode worker that holds its KV (decode-side prefix reuse).
    decode_cfg = replace(base, disaggregation_mode=DisaggregationMode.DECODE, cpus=cpus_text(planned[1]),
                         load_balance_method=LoadBalanceMethod.CACHE_AWARE)
    say(f"starting prefill and decode servers (dp_size={dp_size} each, backend {disagg.transfer_backend}; "
        f"{cpus_note(prefill_cfg, decode_cfg)})")
    results = await asyncio.gather(
        start_server(prefill_cfg, engine, disagg, lambda line: say(f"[prefill] {line}")),
        start_server(decode_cfg, decode_engine or engine, disagg, lambda line: say(f"[decode] {line}")),
        return_exceptions=True,
    )
    started = [r for r in results if isinstance(r, RunningServer)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for server in started:
            await server.close()
        raise failed[0]
    prefill, decode = results
    cache_aware = cache_aware or CacheAwareConfig(max_local_prefill_tokens=disagg.max_local_prefill_tokens)
    router = RouterServer(router_config(prefill, decode, cache_aware, host=host, port=port, log_format=log_format,
                                        api_key=api_key, tls=tls))
    try:
        await router.start()
    except BaseException:
        await prefill.close()
        await decode.close()
        raise
    return prefill, decode, router


async def serve_cluster(engine: EngineConfig, disagg: DisaggConfig, host: str, port: int, dp_size: int, log_format: str,
                        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S, api_key: str | None = None,
                        admin_key: str | None = None, tls: TlsConfig = TlsConfig(),
                        cpus: tuple[str | None, str | None] = (None, None), decode_engine: EngineConfig | None = None,
                        tools: ToolConfig = ToolConfig(), cache_aware: CacheAwareConfig | None = None) -> int:
    prefill, decode, router = await start_cluster(engine, disagg, host=host, port=port, dp_size=dp_size,
                                                  log_format=log_format, api_key=api_key, admin_key=admin_key, tls=tls,
                                                  prefill_cpus=cpus[0], decode_cpus=cpus[1], decode_engine=decode_engine,
                                                  tools=tools, cache_aware=cache_aware)
    signals = StopSignals()
    signals.install()
    name = prefill.controller.model.name
    say(f"prefill http://{host}:{prefill.port} (bootstrap {prefill.bootstrap_port}), decode http://{host}:{decode.port}")
    say(f"ready: {router.url} serving {name} (prefill dp {dp_size} + decode dp {dp_size}, {disagg.transfer_backend}; "
        f"{cpus_note(prefill.controller.server, decode.controller.server)}); "
        f"{prefill.controller.model.engine_summary}")
    say(f"try: curl {router.url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32}}'")
    await signals.requested.wait()
    say("shutting down")
    await drain_cluster(prefill, decode, router, shutdown_timeout_s, signals.hurry)
    return 0


async def drain_cluster(prefill: RunningServer, decode: RunningServer, router: RouterServer, timeout_s: float,
                        hurry: asyncio.Event | None = None) -> None:
    """Drain and stop the router, then drain prefill and decode within what is left of `timeout_s`
    (requests the router aborted are being aborted there already), then stop them."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    await router.drain.run(timeout_s, hurry)
    await router.close()
    left_s = max(deadline - loop.time(), 0.0)
    await asyncio.gather(drain_server(prefill, left_s, hurry), drain_server(decode, left_s, hurry))
    await asyncio.gather(prefill.close(), decode.close())


def run(engine: EngineConfig, disagg: DisaggConfig, host: str, port: int, dp_size: int, log_format: str,
        shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S, api_key: str | None = None, admin_key: str | None = None,
        tls: TlsConfig = TlsConfig(), cpus: tuple[str | None, str | None] = (None, None),
        decode_engine: EngineConfig | None = None, tools: ToolConfig = ToolConfig(),
        cache_aware: CacheAwareConfig | None = None) -> int:
    """`disagg serve`; `cpus` are the --prefill-cpus and --decode-cpus lists (None: planned); `tools`
    the tool-calling flags of both servers; `cache_aware` the router's pick (start_cluster)."""
    configure_logging(log_format)
    try:
        return asyncio.run(serve_cluster(engine, disagg, host, port, dp_size, log_format, shutdown_timeout_s,
                                         api_key, admin_key, tls, cpus, decode_engine, tools, cache_aware))
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
