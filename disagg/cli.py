"""`disagg` command line. The only place that exits the process.

Options are built from the config dataclasses' fields and help text (disagg.cli_args).
"""

from __future__ import annotations

import argparse
import sys

from disagg.cli_args import add_dataclass_args, dataclass_from_args
from disagg.router.launch import add_arguments as add_router_args
from disagg import cluster
from disagg.config import ConfigError, DisaggregationMode, LoadBalanceMethod, ServerConfig, TlsConfig
from disagg.pd_config import (
    ControlConfig, DecodeConfig, DisaggConfig, PrefillConfig, TcpListenerConfig, check_cluster_secret, with_settings,
)
from disagg.cpus import plan_cluster_cpus, usable_cpus, worker_cpu_sets
from disagg.registry_config import BootstrapConfig
from disagg.router.config import CacheAwareConfig, PlannerConfig, PlannerMode
from disagg.sizing import size_to_machine
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.kv_events_config import KV_EVENTS_HELP, parse_kv_events_config
from disagg.tool_config import ToolConfig

ENGINE_PARTS = (ModelConfig, CacheConfig, SchedulerConfig)
# `disagg serve`'s flags that default to None and are sized to the machine (disagg/sizing.py)
SIZED_FLAGS = ("dp_size", "decode_dp_size", "max_waiting_requests", "max_local_prefill_tokens",
               "decode_max_prefill_tokens_per_step", "decode_max_num_seqs", "whole_max_num_seqs", "itl_objective_ms",
               "ttft_objective_ms")
SIZED_HELP = dict.fromkeys(SIZED_FLAGS, "sized to this machine, on the ready line; docs/router.md")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for cls in ENGINE_PARTS:
        add_dataclass_args(parser.add_argument_group(cls.__name__), cls)
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads per worker (default: the size of its share of the CPUs when pinned, "
                             "else cores / dp_size)")
    parser.add_argument("--tensor-parallel-size", "--tp-size", dest="tensor_parallel_size", type=int, default=1,
                        help="processes per DP worker, each holding 1/N of the model (Megatron's split; prefill "
                             "and decode servers may differ, on the CPU; default: 1)")


def engine_from_args(args: argparse.Namespace) -> EngineConfig:
    model, cache, sched = (dataclass_from_args(cls, args) for cls in ENGINE_PARTS)
    return EngineConfig(model=model, cache=cache, scheduler=sched, num_threads=args.num_threads,
                        tensor_parallel_size=args.tensor_parallel_size)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    add_dataclass_args(parser.add_argument_group("ServerConfig"), ServerConfig, skip=("disaggregation_mode",))
    add_dataclass_args(parser.add_argument_group("TlsConfig (HTTPS on this server's port)"), TlsConfig)
    add_dataclass_args(parser.add_argument_group("ToolConfig (tool calling)"), ToolConfig)
    parser.set_defaults(admin_key=ServerConfig().admin_key)  # from the environment, kept out of --help
    parser.add_argument("--kv-events-config", default=None, metavar="JSON", help=KV_EVENTS_HELP)


def secret_defaults() -> dict[str, object]:
    """Defaults read from the environment (config.py): set after the options, so --help never shows them."""
    return dict(force_query_prefill_dp_rank=DisaggConfig().force_query_prefill_dp_rank,
                cluster_secret=DisaggConfig().cluster_secret)


def add_disagg_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), defaults: dict | None = None,
                    shown: dict[str, str] | None = None) -> None:
    """Both sides' settings on every P/D command: a server may change role at run time."""
    for title, cls in (("DisaggConfig (both sides)", DisaggConfig), ("PrefillConfig", PrefillConfig),
                       ("DecodeConfig", DecodeConfig), ("ControlConfig (KV control plane)", ControlConfig),
                       ("TcpListenerConfig (tcp KV listener)", TcpListenerConfig)):
        add_dataclass_args(parser.add_argument_group(title), cls, skip=skip, defaults=defaults, shown=shown)


def disagg_from_args(args: argparse.Namespace, **overrides) -> DisaggConfig:
    parts = {name: dataclass_from_args(cls, args) for name, cls in (
        ("control", ControlConfig), ("tcp_listener", TcpListenerConfig), ("prefill", PrefillConfig),
        ("decode", DecodeConfig))}
    return with_settings(dataclass_from_args(DisaggConfig, args, **parts), **overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg", description="Prefill/decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    unified = sub.add_parser("unified", help="serve one model without disaggregation, dp_size workers behind one port")
    add_server_args(unified)
    for role, method in (("prefill", LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM), ("decode", LoadBalanceMethod.LEAST_LOAD)):
        parser_ = sub.add_parser(role, help=f"serve the {role} role of a P/D cluster")
        add_server_args(parser_)
        add_disagg_args(parser_)
        parser_.set_defaults(load_balance_method=method, **secret_defaults())
    add_serve_args(sub.add_parser("serve", help="a whole local P/D cluster: bootstrap, prefill, decode and router"))
    add_router_args(sub.add_parser("router", help="P/D router (sglang-router compatible arguments)"))
    boot = sub.add_parser("bootstrap", help="run the bootstrap registry standalone")
    add_dataclass_args(boot, BootstrapConfig, skip=("retry",))
    boot.set_defaults(cluster_secret=BootstrapConfig().cluster_secret)
    bench = sub.add_parser("bench", help="benchmarks (engine, transfer)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    add_bench_engine_args(bench_sub.add_parser("engine", help="engine prefill/decode tok/s beside HF transformers"))
    from disagg.bench import transfer

    transfer.add_arguments(bench_sub.add_parser("transfer", help="KV transfer GB/s per backend beside memcpy"))
    from disagg.bench import serve as bench_serve

    bench_serve.add_arguments(bench_sub.add_parser("serve", help="serving latency and goodput under Poisson load"))
    from disagg import top

    top.add_arguments(sub.add_parser("top", help="a live view of a running cluster from its servers' /metrics"))
    return parser


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """`disagg serve`: the engine, the P/D options, what both servers share, the router's port and TLS,
    the CPU split, the decode's own engine settings; every flag from the config that takes it."""
    add_engine_args(serve)
    # serve draws a cluster secret of its own when none is given: there is nothing to opt out of; the
    # settings of disagg/sizing.py default to None here: sized to the machine unless given
    add_disagg_args(serve, skip=("bootstrap_port", "bootstrap_host", "insecure_no_cluster_secret"),
                    defaults={"max_local_prefill_tokens": None, "whole_max_num_seqs": None, "itl_objective_ms": None},
                    shown=SIZED_HELP)
    add_dataclass_args(serve.add_argument_group("both servers (--host binds the router too)"), ServerConfig,
                       only=cluster.SHARED_SERVER_FIELDS,
                       defaults={"dp_size": None, "max_waiting_requests": None, "ttft_objective_ms": None},
                       shown=SIZED_HELP)
    add_dataclass_args(serve.add_argument_group("ToolConfig (tool calling, on both servers)"), ToolConfig)
    add_dataclass_args(serve.add_argument_group("the router and the CPU split"), cluster.ClusterOptions,
                       only=("port", "prefill_cpus", "decode_cpus"))
    add_dataclass_args(serve.add_argument_group("TlsConfig (HTTPS on the router's port)"), TlsConfig)
    add_dataclass_args(serve.add_argument_group("the router's cache_aware pick"), CacheAwareConfig,
                       only=("local_prefill_min_prefill_load",))
    add_dataclass_args(serve.add_argument_group("the decode server's own engine settings"), cluster.DecodeOverrides,
                       shown=SIZED_HELP)
    add_dataclass_args(serve.add_argument_group("the router's role planner"), PlannerConfig,
                       defaults={"planner": PlannerMode.AUTO})
    serve.set_defaults(admin_key=ServerConfig().admin_key, **secret_defaults())


def add_bench_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--quantization", default="none",
                        help="comma list of weight forms to run (none, int8, int4, gguf, gguf_float), each beside dense HF")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=2, help="best of N runs")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    parser.add_argument("--kernels", default="torch,auto",
                        help="comma-separated kernel choices to compare (torch: pure-torch ops; auto: csrc where built)")
    parser.add_argument("--isas", default=None,
                        help="comma list of csrc instruction sets to compare on this CPU (avx512, avx2, base), each "
                             "a form of every csrc row; default: the best this CPU runs")
    parser.add_argument("--kv-cache-dtypes", default="auto",
                        help="comma list of KV cache dtypes to run (auto: the model's; bfloat16); every form's "
                             "engine stays loaded for the whole run (weights and a 256 MiB cache each)")
    parser.add_argument("--huge-pages", default="on",
                        help="comma list: on (the weights and KV cache in transparent huge pages, as served), off "
                             "(4 KB pages: --no-huge-pages); 'on,off' runs both forms in turns")
    parser.add_argument("--profile", action="store_true", help="print where decode time goes (torch profiler)")
    from disagg.bench.peers import peer_spec

    parser.add_argument("--peers", nargs="+", default=[], metavar="NAME=URL", type=peer_spec,
                        help="servers started by the user (vLLM CPU, llama.cpp, disagg) to drive through one streaming client")
    parser.add_argument("--skip-engine", action="store_true", help="only drive the --peers")
    parser.add_argument("--peer-input-len", type=int, default=250, help="prompt tokens (about) for --peers")
    parser.add_argument("--peer-output-len", type=int, default=64, help="output tokens for --peers")
    parser.add_argument("--peer-sequential", type=int, default=8, help="one-stream requests per peer")
    parser.add_argument("--peer-streams", type=int, default=16, help="concurrent streams per peer")
    parser.add_argument("--out", default=None, help="write results as JSON here")


def run_server(args: argparse.Namespace) -> int:
    """`disagg unified|prefill|decode`: every check before anything binds or loads, then the server."""
    from disagg import launch

    mode = DisaggregationMode.NULL if args.command == "unified" else DisaggregationMode(args.command)
    disagg = disagg_from_args(args) if mode is not DisaggregationMode.NULL else DisaggConfig()
    server = dataclass_from_args(ServerConfig, args, disaggregation_mode=mode, tls=dataclass_from_args(TlsConfig, args),
                                 tools=dataclass_from_args(ToolConfig, args))
    check_cluster_secret(server, disagg)
    worker_cpu_sets(server.cpus, server.dp_size, usable_cpus())
    kv_events = parse_kv_events_config(args.kv_events_config)
    return launch.run(server, engine_from_args(args), disagg, kv_events)


def run_cluster(args: argparse.Namespace) -> int:
    """`disagg serve`: a bad CPU list, timeout or limit fails before anything starts; what the user
    left unset of disagg/sizing.py's settings is sized to the CPUs each role gets."""
    planned = plan_cluster_cpus(usable_cpus(), args.prefill_cpus, args.decode_cpus)
    sized = size_to_machine(*planned, itl_slo_ms=args.itl_slo_ms, ttft_slo_ms=args.ttft_slo_ms,
                            **{name: getattr(args, name) for name in SIZED_FLAGS})
    for name in SIZED_FLAGS:
        setattr(args, name, getattr(sized, name))
    disagg = disagg_from_args(args, bootstrap_port=0)
    servers = ServerConfig(**{name: getattr(args, name) for name in cluster.SHARED_SERVER_FIELDS},
                           tools=dataclass_from_args(ToolConfig, args))
    options = cluster.ClusterOptions(
        servers=servers, port=args.port, tls=dataclass_from_args(TlsConfig, args), prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus, decode=dataclass_from_args(cluster.DecodeOverrides, args),
        cache_aware=dataclass_from_args(CacheAwareConfig, args), planning=dataclass_from_args(PlannerConfig, args),
        sized=sized.notes)
    cluster.server_configs(options)  # both servers' configs: their CPU lists and limits are checked here
    return cluster.run(engine_from_args(args), disagg, options)


def run_top(args: argparse.Namespace) -> int:
    """`disagg top`: until Ctrl-C (or one snapshot with --once)."""
    import asyncio

    from disagg import top

    try:
        return asyncio.run(top.run(args.url, args.interval, args.once))
    except KeyboardInterrupt:
        return 0


def run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("unified", "prefill", "decode"):
        return run_server(args)
    if args.command == "serve":
        return run_cluster(args)
    if args.command == "router":
        from disagg.router.launch import main as router_main

        return router_main(args)
    if args.command == "bootstrap":
        from bootstrap.server import run_bootstrap

        return run_bootstrap(dataclass_from_args(BootstrapConfig, args))
    if args.command == "top":
        return run_top(args)
    if args.command == "bench" and args.bench == "serve":
        from disagg.bench import serve as bench_serve

        return bench_serve.run(args)
    if args.command == "bench" and args.bench == "transfer":
        from disagg.bench import transfer

        return transfer.dispatch(args)
    if args.command == "bench":
        from disagg.bench import engine as bench_engine

        return bench_engine.run(args)
    return 2


def main(argv: list[str] | None = None) -> None:
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        print(f"disagg: error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
