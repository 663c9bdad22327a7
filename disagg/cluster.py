"""`disagg serve`: a whole local P/D cluster in one command, on 127.0.0.1.

Bootstrap registry (inside the prefill server), a prefill server and a decode server with
`dp_size` workers each, and the router in front. Servers behind the router use free ports; the
router listens on `--port`. SIGTERM or Ctrl-C drains the router first (its requests span both
servers), then prefill and decode within what is left of `--shutdown-timeout-s`, then stops them.

Every part gets the same cluster secret (a random one when none is given), so the control streams,
the KV listeners and the registry writes are authenticated; `api_key` guards the router and both
servers, `admin_key` the servers' admin routes; `tls` puts HTTPS on the router's port (the servers
behind it speak plain HTTP to it). Both servers get the same admission limits (`--max-waiting-requests`,
`--max-kv-usage`, `--ttft-objective-ms`), so an overloaded cluster answers 429 at once through the router.
"""

from __future__ import annotations

import asyncio
import secrets
import sys
from dataclasses import dataclass, field, replace

from disagg.config import DisaggregationMode, LoadBalanceMethod, ServerConfig, TlsConfig
from disagg.pd_config import DisaggConfig
from disagg.cpus import format_cpu_list, plan_cluster_cpus, usable_cpus
from disagg.engine_config import EngineConfig
from disagg.drain import StopSignals
from disagg.launch import RunningServer, drain_server, say, start_server
from disagg.logs import configure_logging
from disagg.router.config import CacheAwareConfig, PlannerConfig, PlannerMode, PrefillEndpoint, RouterConfig
from disagg.router.policy import Policy
from disagg.router.server import RouterServer


def cpus_text(cpus: frozenset[int] | None) -> str | None:
    """A planned CPU set as ServerConfig.cpus takes it (None: not pinned)."""
    return None if cpus is None else format_cpu_list(cpus)


def cpus_note(prefill_cfg: ServerConfig, decode_cfg: ServerConfig) -> str:
    """`prefill on CPUs 0, decode on CPUs 1` for the progress and ready lines."""
    return ", ".join(f"{role} on CPUs {cfg.cpus or 'any'}" for role, cfg in (("prefill", prefill_cfg), ("decode", decode_cfg)))


def router_config(prefill: RunningServer, decode: RunningServer, cache_aware: CacheAwareConfig,
                  planning: PlannerConfig = PlannerConfig(), **settings) -> RouterConfig:
    """The router in front: cache_aware, so a shared prefix goes to the prefill rank that holds it, and
    a short rest to the decode alone when the decode prefills locally (its --max-local-prefill-tokens,
    which the router reads from its /server_info) and the prefill is busy enough
    (--local-prefill-min-prefill-load)."""
    host = settings["host"]
    return RouterConfig(
        policy=Policy.CACHE_AWARE, cache_aware=cache_aware, planning=planning,
        prefill=(PrefillEndpoint(f"http://{host}:{prefill.port}", prefill.bootstrap_port),),
        decode=(f"http://{host}:{decode.port}",), **settings)


# ServerConfig's fields that `disagg serve` sets alike on both of its servers (`host` binds the router too)
SHARED_SERVER_FIELDS = ("host", "dp_size", "log_format", "api_key", "admin_key", "max_waiting_requests",
                        "max_kv_usage", "ttft_objective_ms", "shutdown_timeout_s", "otlp_traces_endpoint")


@dataclass(frozen=True)
class DecodeOverrides:
    """`disagg serve`'s decode-only engine settings; None: the prefill's (the engine flags')."""

    decode_max_num_batched_tokens: int | None = field(default=None, metadata={"help": (
        "the decode server's token budget per step (default: --max-num-batched-tokens); with "
        "--max-local-prefill-tokens a small one chunks the prompts the decode prefills itself, "
        "so the requests decoding beside them keep their pace")})
    decode_max_prefill_tokens_per_step: int | None = field(default=None, metadata={"help": (
        "the decode server's prompt tokens per step (default: --max-prefill-tokens-per-step); "
        "with --max-local-prefill-tokens a small one chunks the prompts the decode prefills "
        "itself while every decoding request still gets its token each step")})
    decode_max_num_seqs: int | None = field(default=None, metadata={"help": (
        "the decode server's requests decoding in one step (default: --max-num-seqs); past it the "
        "latest whose KV landed wait for a slot, so the others keep their pace under overload")})
    decode_dp_size: int | None = field(default=None, metadata={"help": (
        "the decode server's DP workers (default: --dp-size)")})
    decode_tensor_parallel_size: int | None = field(default=None, metadata={"aliases": ("--decode-tp-size",), "help": (
        "the decode server's TP size (default: --tensor-parallel-size, which then sizes the "
        "prefill alone); each decode rank receives its KV heads from the prefill ranks holding them")})

    def engine(self, engine: EngineConfig) -> EngineConfig | None:
        """The decode's engine when these make it differ from `engine` (the prefill's), else None."""
        scheduler = {name: value for name, value in (
            ("max_num_batched_tokens", self.decode_max_num_batched_tokens),
            ("max_prefill_tokens_per_step", self.decode_max_prefill_tokens_per_step),
            ("max_num_seqs", self.decode_max_num_seqs)) if value is not None}
        decode = replace(engine, scheduler=replace(engine.scheduler, **scheduler),
                         tensor_parallel_size=self.decode_tensor_parallel_size or engine.tensor_parallel_size)
        return None if decode == engine else decode


@dataclass(frozen=True)
class ClusterOptions:
    """What `disagg serve` sets beside the engine and the P/D config: what both servers share
    (`servers`: DP size, logs, keys, tool calling, the admission limits; `host` binds the router too),
    where the router listens (`port`, `tls`), the CPU split, the decode's own engine settings and the
    router's cache_aware pick."""

    servers: ServerConfig = field(default_factory=lambda: ServerConfig(dp_size=2))
    port: int = field(default=30000, metadata={"help": "the router's port"})
    tls: TlsConfig = TlsConfig()  # HTTPS on the router's port; the servers behind it speak plain HTTP to it
    prefill_cpus: str | None = field(default=None, metadata={"help": (
        "the prefill server's CPUs (a Linux CPU list: 0-3,8), split among its DP workers "
        "(default: the first half of the CPUs this process may use; with one CPU, that one)")})
    decode_cpus: str | None = field(default=None, metadata={"help": (
        "the decode server's CPUs (default: the usable CPUs prefill does not take; the second "
        "half when neither is given); the lists may overlap")})
    decode: DecodeOverrides = DecodeOverrides()
    cache_aware: CacheAwareConfig = CacheAwareConfig()
    planning: PlannerConfig = PlannerConfig()  # the router's role planner
    sized: tuple[str, ...] = ()  # the defaults sized to the machine, and why (the ready line says them)


def server_configs(o: ClusterOptions) -> tuple[ServerConfig, ServerConfig]:
    """The prefill's and the decode's: what they share from `o`, each its planned CPUs, DP size and DP
    pick; both can switch roles (POST /pd_role_switch) when the planner runs in auto mode."""
    planned = plan_cluster_cpus(usable_cpus(), o.prefill_cpus, o.decode_cpus)
    base = replace(o.servers, port=0)
    switchable = o.planning.planner is PlannerMode.AUTO
    prefill_cfg = replace(base, disaggregation_mode=DisaggregationMode.PREFILL, cpus=cpus_text(planned[0]),
                          load_balance_method=LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM, enable_pd_role_switch=switchable)
    # A conversation's later turns go back to the decode worker that holds its KV (decode-side prefix reuse).
    decode_cfg = replace(base, disaggregation_mode=DisaggregationMode.DECODE, cpus=cpus_text(planned[1]),
                         load_balance_method=LoadBalanceMethod.CACHE_AWARE, enable_pd_role_switch=switchable,
                         dp_size=o.decode.decode_dp_size or base.dp_size)
    return prefill_cfg, decode_cfg


async def start_cluster(engine: EngineConfig, disagg: DisaggConfig, options: ClusterOptions = ClusterOptions()
                        ) -> tuple[RunningServer, RunningServer, RouterServer]:
    """Start the cluster that `options` describe. Prefill and decode each get their own CPUs
    (`plan_cluster_cpus`: by default the first and the second half of the usable ones); the router and
    the registry are not pinned."""
    o = options
    if disagg.cluster_secret is None:  # one local cluster: a fresh secret nobody else holds
        disagg = replace(disagg, cluster_secret=secrets.token_hex(32))
    prefill_cfg, decode_cfg = server_configs(o)
    say(f"starting prefill and decode servers (prefill dp {prefill_cfg.dp_size} + decode dp {decode_cfg.dp_size}, "
        f"backend {disagg.transfer_backend}; {cpus_note(prefill_cfg, decode_cfg)})")
    results = await asyncio.gather(
        start_server(prefill_cfg, engine, disagg, lambda line: say(f"[prefill] {line}")),
        start_server(decode_cfg, o.decode.engine(engine) or engine, disagg, lambda line: say(f"[decode] {line}")),
        return_exceptions=True,
    )
    started = [r for r in results if isinstance(r, RunningServer)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for server in started:
            await server.close()
        raise failed[0]
    prefill, decode = results
    router = RouterServer(router_config(prefill, decode, o.cache_aware, o.planning, host=o.servers.host, port=o.port,
                                        log_format=o.servers.log_format, api_key=o.servers.api_key, tls=o.tls,
                                        otlp_traces_endpoint=o.servers.otlp_traces_endpoint))
    try:
        await router.start()
    except BaseException:
        await prefill.close()
        await decode.close()
        raise
    return prefill, decode, router


async def serve_cluster(engine: EngineConfig, disagg: DisaggConfig, options: ClusterOptions) -> int:
    prefill, decode, router = await start_cluster(engine, disagg, options)
    signals = StopSignals()
    signals.install()
    name = prefill.controller.model.name
    host, p_cfg, d_cfg = options.servers.host, prefill.controller.server, decode.controller.server
    say(f"prefill http://{host}:{prefill.port} (bootstrap {prefill.bootstrap_port}), decode http://{host}:{decode.port}")
    if options.sized:
        say("sized to this machine: " + "; ".join(options.sized))
    say(f"ready: {router.url} serving {name} (prefill dp {p_cfg.dp_size} + decode dp {d_cfg.dp_size}, "
        f"{disagg.transfer_backend}; {cpus_note(p_cfg, d_cfg)}; planner {options.planning.planner.value}); "
        f"{prefill.controller.model.engine_summary}")
    say(f"try: curl {router.url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], \"max_tokens\": 32}}'")
    await signals.requested.wait()
    say("shutting down")
    await drain_cluster(prefill, decode, router, options.servers.shutdown_timeout_s, signals.hurry)
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


def run(engine: EngineConfig, disagg: DisaggConfig, options: ClusterOptions) -> int:
    """`disagg serve`."""
    configure_logging(options.servers.log_format)
    try:
        return asyncio.run(serve_cluster(engine, disagg, options))
    except Exception as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
