"""Command-line options of `disagg router`, in sglang-router's shape:

    disagg router --port 30000 --prefill http://p1:30001 8998 --prefill http://p2:30001 \
        --decode http://d1:30002 --decode http://d2:30002 --policy round_robin

Scalar options come from RouterConfig's fields and help text; `--prefill URL [BOOTSTRAP_PORT]` and
`--decode URL` repeat. `--service-discovery --prefill-selector app=prefill --decode-selector app=decode`
finds the servers through the Kubernetes API instead (DiscoveryConfig, sglang-router's flag names). `--pd-disaggregation` and `--request-timeout-secs` are accepted so that
sglang-router command lines work unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from disagg.cli_args import add_dataclass_args, dataclass_from_args, scalar_type
from disagg.config import TlsConfig
from disagg.router.config import (
    DEFAULT_BOOTSTRAP_PORT, CacheAwareConfig, DiscoveryConfig, PlannerConfig, RouterConfig, parse_prefill,
)

_SERVER_LISTS = ("prefill", "decode", "discovery", "tls", "cache_aware")  # not scalars: built by hand below


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the router's options to `parser` (a sub-command parser of `disagg`)."""
    parser.add_argument(
        "--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
        help=f"a prefill server and its bootstrap port (default {DEFAULT_BOOTSTRAP_PORT}; 'none' sends null; HOST:PORT "
             "for a standalone registry the server registers with, --external-registry); repeat",
    )
    parser.add_argument("--decode", nargs=1, action="append", default=[], metavar="URL",
                        help="a decode server; repeat")
    parser.add_argument("--pd-disaggregation", action="store_true",
                        help="accepted for sglang-router compatibility (this router always disaggregates)")
    add_discovery_arguments(parser.add_argument_group("service discovery (Kubernetes)"))
    add_dataclass_args(parser, RouterConfig, skip=_SERVER_LISTS)  # scalars, with their aliases and choices
    add_dataclass_args(parser.add_argument_group("TlsConfig (HTTPS on the router's port)"), TlsConfig)
    add_dataclass_args(parser.add_argument_group("CacheAwareConfig (--policy cache_aware)"), CacheAwareConfig)
    add_dataclass_args(parser.add_argument_group("PlannerConfig (roles that switch)"), PlannerConfig)


def add_discovery_arguments(group) -> None:
    """`--service-discovery` and DiscoveryConfig's options, under sglang-router's flag names."""
    group.add_argument("--service-discovery", action="store_true",
                       help="find prefill and decode servers by watching pods through the Kubernetes API "
                            "(needs the extra k8s)")
    hints = typing.get_type_hints(DiscoveryConfig)
    for f in dataclasses.fields(DiscoveryConfig):
        dest = "discovery_" + f.name
        if typing.get_origin(hints[f.name]) is tuple:
            group.add_argument(f.metadata["flag"], dest=dest, nargs="+", default=[], metavar="KEY=VALUE",
                               help=f.metadata["help"])
        else:
            shown = "" if f.default is None else f" (default: {f.default})"
            group.add_argument(f.metadata["flag"], dest=dest, type=scalar_type(hints[f.name]), default=f.default,
                               metavar=f.name.upper(), help=f.metadata["help"] + shown)


def _selector_items(values: list[str]) -> tuple[str, ...]:
    """`a=b c=d` given as one argument (a YAML list item) or as several."""
    return tuple(item for value in values for item in value.split())


def discovery_from_args(args: argparse.Namespace) -> DiscoveryConfig | None:
    """DiscoveryConfig when `--service-discovery` is given, else None (its options are then ignored)."""
    if not getattr(args, "service_discovery", False):
        return None
    values = {f.name: getattr(args, "discovery_" + f.name) for f in dataclasses.fields(DiscoveryConfig)}
    for name in ("prefill_selector", "decode_selector"):
        values[name] = _selector_items(values[name])
    return DiscoveryConfig(**values)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """RouterConfig from parsed options; ConfigError names the bad value."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)
              if f.name not in _SERVER_LISTS and hasattr(args, f.name)}
    prefill = tuple(parse_prefill(list(v)) for v in args.prefill or ())
    decode = tuple(v[0] for v in args.decode or ())
    return RouterConfig(prefill=prefill, decode=decode, discovery=discovery_from_args(args),
                        tls=dataclass_from_args(TlsConfig, args),
                        cache_aware=dataclass_from_args(CacheAwareConfig, args),
                        planning=dataclass_from_args(PlannerConfig, args), **values)


def main(args: argparse.Namespace) -> int:
    """`disagg router`: build the config and serve until interrupted; returns the exit code."""
    config = config_from_args(args)
    if config.discovery is not None:
        from disagg.router.discovery import load_client

        load_client()  # a missing extra is a clear error before anything starts
    from disagg.router.server import run  # aiohttp loads only when the router really runs

    return run(config)
