"""The router's frozen configuration and the parsing of SGLang-router style server lists.

`--prefill URL [BOOTSTRAP_PORT]` (repeatable; port defaults to 8998, `none` sends `null`) and
`--decode URL` (repeatable) become `PrefillEndpoint`s and decode URLs here, so that the CLI and
tests build the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from disagg.config import (
    SHUTDOWN_TIMEOUT_HELP, SHUTDOWN_TIMEOUT_S, Choice, ConfigError, TlsConfig, check_shutdown_timeout, otlp_traces_endpoint,
)
from disagg.router.policy import Policy

DEFAULT_BOOTSTRAP_PORT = 8998
LOG_FORMATS = ("console", "json")
# sglang-router's --max-tree-size is 2**26 symbols per tenant; a Python tree holds a symbol in 1 byte
# (a character) to 8 (a token id) plus a node per edge, so the default here is 16x smaller.
DEFAULT_MAX_TREE_SIZE = 2**22


class PdProtocol(Choice):
    """How the router runs a request's two legs."""

    PUSH = "push"  # SGLang's: both legs at once, the bootstrap fields tell the decode where the KV is
    PULL = "pull"  # vLLM's: the prefill first, then its kv_transfer_params ticket to the decode


def _check_url(url: str, flag: str) -> str:
    """The URL without a trailing slash; ConfigError unless it is http(s)://host[:port]."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag} needs an http:// or https:// URL with a host, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise ConfigError(f"{flag} URL has an invalid port: {url!r}") from None
    return url.rstrip("/")


@dataclass(frozen=True)
class PrefillEndpoint:
    """One prefill server: its HTTP URL, the port of its bootstrap registry (None: send null) and that
    registry's host when it is not the server's own (a standalone `disagg bootstrap`)."""

    url: str
    bootstrap_port: int | None = DEFAULT_BOOTSTRAP_PORT
    registry_host: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", _check_url(self.url, "--prefill"))
        port = self.bootstrap_port
        if port is not None and not 1 <= port <= 65535:
            raise ConfigError(f"bootstrap port of {self.url} must be in [1, 65535] or none, got {port}")

    @property
    def bootstrap_host(self) -> str:
        """The host decode workers use to reach this prefill's bootstrap registry."""
        return self.registry_host or urlsplit(self.url).hostname or ""


def parse_prefill(values: list[str]) -> PrefillEndpoint:
    """`["URL"]` or `["URL", "PORT"|"none"|"HOST:PORT"]`, as given to one `--prefill` (HOST:PORT: a
    registry of its own, `disagg bootstrap`, that the server registers with: --external-registry)."""
    if not 1 <= len(values) <= 2:
        raise ConfigError(f"--prefill takes a URL and an optional bootstrap port, got {' '.join(values)!r}")
    if len(values) == 1:
        return PrefillEndpoint(values[0])
    raw_port = values[1].strip()
    if raw_port.lower() == "none":
        return PrefillEndpoint(values[0], None)
    host, _, raw_port = raw_port.rpartition(":")
    try:
        port = int(raw_port)
    except ValueError:
        raise ConfigError(f"bootstrap port must be an integer, HOST:PORT or 'none', got {values[1].strip()!r}") from None
    return PrefillEndpoint(values[0], port, host.strip("[]") or None)


@dataclass(frozen=True)
class CacheAwareConfig:
    """`--policy cache_aware`: sglang-router's flags, defaults (but --max-tree-size) and semantics
    (docs/router.md, "cache_aware")."""

    cache_threshold: float = field(
        default=0.3, metadata={"help": "cache_aware: a prefill whose tree matches more than this share of the "
                                       "prompt gets it; else the prefill with the smallest tree"})
    balance_abs_threshold: int = field(
        default=64, metadata={"help": "cache_aware: the prefills are imbalanced (shortest queue wins) when the most "
                                      "and fewest requests in flight differ by more than this ..."})
    balance_rel_threshold: float = field(
        default=1.5, metadata={"help": "cache_aware: ... and the most is more than this times the fewest"})
    max_tree_size: int = field(
        default=DEFAULT_MAX_TREE_SIZE, metadata={"help": "cache_aware: symbols (characters or token ids) one "
                                                         "prefill (DP rank) tree keeps; least recently used first out"})

    prefill_kv_events: tuple[str, ...] = field(
        default=(), metadata={"help": "cache_aware: each --prefill server's KV-event endpoint (its workers' "
                                      "--kv-events-config endpoint as the router reaches it, tcp://HOST:PORT; DP rank "
                                      "r at PORT + r), comma-separated in --prefill order: the prefill pick then "
                                      "reads what the workers hold (prompts tokenized by the server's /tokenize)"})
    local_prefill_min_prefill_load: int = field(
        default=1, metadata={"help": "cache_aware, with decodes that prefill short rests themselves (their "
                                     "--max-local-prefill-tokens, read from their /server_info): a short request "
                                     "goes to its decode alone only while every eligible prefill has at least this "
                                     "many prefill legs unanswered; below that a prefill computes it, so the decode "
                                     "keeps its pace (Dynamo's prefill-queue rule). 0: whenever its rest is short"})

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_kv_events", tuple(self.prefill_kv_events))
        for endpoint in self.prefill_kv_events:
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"--prefill-kv-events takes tcp://HOST:PORT or ipc:// endpoints, got {endpoint!r}")
        if self.local_prefill_min_prefill_load < 0:
            raise ConfigError(f"--local-prefill-min-prefill-load must be >= 0, got {self.local_prefill_min_prefill_load}")
        if not 0 <= self.cache_threshold <= 1:
            raise ConfigError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ConfigError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1:
            raise ConfigError(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_size < 1:
            raise ConfigError(f"--max-tree-size must be positive, got {self.max_tree_size}")


class PlannerMode(Choice):
    OFF = "off"
    ADVISORY = "advisory"  # estimate and propose, export disagg_planner_* gauges; switch nothing
    AUTO = "auto"  # also switch one server per interval (POST /pd_role_switch), after the same proposal twice


@dataclass(frozen=True)
class PlannerConfig:
    """The role planner (docs/router.md, "Planner"): every `planner_interval_s` it reads each server's
    per-step engine metrics, estimates TTFT and ITL, and proposes moving one server between roles."""

    planner: PlannerMode = field(default=PlannerMode.OFF, metadata={
        "help": "off, advisory (estimate, propose, export disagg_planner_* gauges) or auto (also switch servers "
                "started with --enable-pd-role-switch, one per interval)"})
    ttft_slo_ms: float = field(default=1500.0, metadata={"help": "planner: the time-to-first-token objective"})
    itl_slo_ms: float = field(default=60.0, metadata={"help": "planner: the inter-token latency objective"})
    planner_interval_s: float = field(default=5.0, metadata={"help": "planner: seconds between decisions"})

    def __post_init__(self) -> None:
        PlannerMode.coerce_field(self, "planner")
        for name in ("ttft_slo_ms", "itl_slo_ms", "planner_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")


def _flag(name: str, help_text: str) -> dict:
    return {"flag": name, "help": help_text}


@dataclass(frozen=True)
class DiscoveryConfig:
    """`--service-discovery`: the router finds its servers by watching pods through the Kubernetes API.

    Flag names are sglang-router's (`metadata["flag"]`). A pod is a server once it is Ready, not
    terminating and answers the router's own `GET /health`; its HTTP port is its container port
    named `http`, else `port`; its bootstrap port is the `bootstrap_port_annotation` annotation,
    else its container port named `bootstrap`, else 8998.
    """

    prefill_selector: tuple[str, ...] = field(
        default=(), metadata=_flag("--prefill-selector", "label selector of prefill pods: key=value [key=value ...]"))
    decode_selector: tuple[str, ...] = field(
        default=(), metadata=_flag("--decode-selector", "label selector of decode pods: key=value [key=value ...]"))
    namespace: str | None = field(
        default=None, metadata=_flag("--service-discovery-namespace",
                                     "namespace to watch (default: every namespace, which needs cluster-wide rights)"))
    kubeconfig: str | None = field(
        default=None, metadata=_flag("--kubeconfig", "kubeconfig file to reach the API server from outside a pod "
                                                     "(default: the pod's service account, else $KUBECONFIG)"))
    port: int = field(default=80, metadata=_flag("--service-discovery-port",
                                                 "HTTP port of a pod that names no container port 'http'"))
    bootstrap_port_annotation: str = field(
        default="sglang.ai/bootstrap-port",
        metadata=_flag("--bootstrap-port-annotation", "pod annotation holding a prefill's bootstrap port"))
    watch_timeout_s: float = field(
        default=300.0, metadata=_flag("--service-discovery-watch-timeout-s",
                                      "the API server ends each watch after this long; it is then resumed"))
    api_timeout_s: float = field(
        default=30.0, metadata=_flag("--service-discovery-api-timeout-s", "limit of one list call to the API server"))
    backoff_s: float = field(
        default=0.5, metadata=_flag("--service-discovery-backoff-s", "first wait before a failed list/watch is retried"))
    max_backoff_s: float = field(
        default=30.0, metadata=_flag("--service-discovery-max-backoff-s", "the retry wait doubles up to this"))

    def __post_init__(self) -> None:
        for name in ("prefill_selector", "decode_selector"):
            items = tuple(getattr(self, name))
            object.__setattr__(self, name, items)
            if not items:
                raise ConfigError(f"service discovery needs {_flag_of(name)} (key=value ...)")
            for item in items:
                key, sep, _value = item.partition("=")
                if not sep or not key.strip():
                    raise ConfigError(f"{_flag_of(name)} takes key=value items, got {item!r}")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--service-discovery-port must be in [1, 65535], got {self.port}")
        if not self.bootstrap_port_annotation:
            raise ConfigError("--bootstrap-port-annotation must not be empty")
        for name in ("watch_timeout_s", "api_timeout_s", "backoff_s", "max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_flag_of(name)} must be positive, got {getattr(self, name)}")
        if self.max_backoff_s < self.backoff_s:
            raise ConfigError("--service-discovery-max-backoff-s must be at least --service-discovery-backoff-s")

    @property
    def prefill_label_selector(self) -> str:
        """The API's `labelSelector` of prefill pods: `a=b,c=d`."""
        return ",".join(item.strip() for item in self.prefill_selector)

    @property
    def decode_label_selector(self) -> str:
        """The API's `labelSelector` of decode pods."""
        return ",".join(item.strip() for item in self.decode_selector)


def _flag_of(name: str) -> str:
    return next(f.metadata["flag"] for f in fields(DiscoveryConfig) if f.name == name)


@dataclass(frozen=True)
class RouterConfig:
    """`disagg router`: one HTTP front that pairs a prefill and a decode server per request."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=30000, metadata={"help": "HTTP port (0: any free port)"})
    prefill: tuple[PrefillEndpoint, ...] = field(default=(), metadata={"help": "prefill servers"})
    decode: tuple[str, ...] = field(default=(), metadata={"help": "decode server URLs"})
    policy: Policy = field(
        default=Policy.ROUND_ROBIN,
        metadata={"help": "pair selection: round_robin, random, least_load or cache_aware (prefill by prompt "
                          "prefix, decode by power of two choices)", "choices": Policy.values()},
    )
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    planning: PlannerConfig = field(default_factory=PlannerConfig)  # --planner and its options
    protocol: PdProtocol = field(
        default=PdProtocol.PUSH,
        metadata={"help": "P/D protocol: push (SGLang: both legs at once, bootstrap fields) or pull "
                          "(vLLM: the prefill first, its kv_transfer_params ticket to the decode)",
                  "choices": PdProtocol.values()},
    )
    test_external_dp_routing: bool = field(
        default=False,
        metadata={"help": "test mode: pin random DP ranks on both legs and verify the decode's reported rank"},
    )
    trust_client_routing: bool = field(
        default=False,
        metadata={"help": "pass the client's DP routing on to the servers (routed_dp_rank, disagg_prefill_dp_rank, "
                          "data_parallel_rank, the X-data-parallel-rank header); off: dropped. kv_transfer_params and "
                          "bootstrap_* are always dropped: the router sets them"},
    )
    request_timeout_s: float = field(default=300.0, metadata={"help": "limit of one request, both legs",
                                                              "aliases": ("--request-timeout-secs",)})  # sglang-router's
    connect_timeout_s: float = field(default=10.0, metadata={"help": "limit for opening a connection to a server"})
    retry_max_retries: int = field(
        default=2, metadata={"help": "a request whose leg failed before any byte reached the client (a server "
                                     "unreachable, a 503 such as a dead DP rank, or a 429 from an overloaded server "
                                     "when its role has another server) is sent again to a pair with a fresh room, "
                                     "at most this many times (0: never)"})
    health_check_interval_s: float = field(
        default=5.0, metadata={"help": "seconds between health checks of every server (0: no checks)"}
    )
    health_check_timeout_s: float = field(
        default=2.0, metadata={"help": "limit of one health check or /server_info read"}
    )
    role_poll_interval_s: float = field(
        default=1.0, metadata={"help": "seconds between /server_info reads of each server that may switch roles "
                                       "(--enable-pd-role-switch): a server that switched is routed by its new role "
                                       "from the next read (0: at health checks only)"})
    otlp_traces_endpoint: str | None = field(default_factory=lambda: otlp_traces_endpoint(), metadata={"help": (
        "send OpenTelemetry traces over OTLP/HTTP (protobuf) to this URL: a span per request with its pick, its legs "
        "and its path, whose context both servers receive (traceparent), so their spans join the trace "
        "(default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off; needs the tracing extra)")})
    federate_metrics: bool = field(
        default=True, metadata={"help": "the router's /metrics also carries the servers' vllm:* and sglang:* "
                                        "families, added up over them (each server's /metrics read at every scrape)"})
    max_body_bytes: int = field(default=64 << 20, metadata={"help": "largest accepted request body"})
    max_connections: int = field(default=1024, metadata={"help": "open connections to all servers together"})
    log_format: str = field(default="console", metadata={"help": "console or json", "choices": ("console", "json")})
    shutdown_timeout_s: float = field(default=SHUTDOWN_TIMEOUT_S, metadata={"help": SHUTDOWN_TIMEOUT_HELP,
                                                                             "aliases": ("--shutdown-timeout",)})  # vLLM's
    api_key: str | None = field(
        default=None, repr=False,
        metadata={"help": "require 'Authorization: Bearer KEY' from clients (not on /health, /metrics); the header "
                          "goes on to both servers, so start them with the same --api-key"})
    discovery: DiscoveryConfig | None = field(
        default=None, metadata={"help": "find the servers through the Kubernetes API instead of --prefill/--decode"})
    tls: TlsConfig = field(default_factory=TlsConfig)  # HTTPS on the router's own port
    upstream_ca_certs: str | None = field(
        default=None, metadata={"help": "CA certificates (PEM) trusted for https:// --prefill and --decode servers "
                                        "(default: the system's trust store)"})
    upstream_certfile: str | None = field(
        default=None, metadata={"help": "client certificate (PEM) the router shows https:// servers that ask for "
                                        "one (--ssl-cert-reqs 2 on the servers)"})
    upstream_keyfile: str | None = field(default=None, metadata={"help": "private key (PEM) of --upstream-certfile"})

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it unset to turn it off)")
        if self.upstream_keyfile is not None and self.upstream_certfile is None:
            raise ConfigError("--upstream-keyfile needs --upstream-certfile")
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(_check_url(u, "--decode") for u in self.decode))
        if self.discovery is not None and (self.prefill or self.decode):
            raise ConfigError("--service-discovery finds the servers itself: give no --prefill or --decode")
        if self.discovery is None and (not self.prefill or not self.decode):
            raise ConfigError("the router needs at least one --prefill and one --decode server (or --service-discovery)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        Policy.coerce_field(self, "policy")
        PdProtocol.coerce_field(self, "protocol")
        events = self.cache_aware.prefill_kv_events
        if events and (self.policy is not Policy.CACHE_AWARE or len(events) != len(self.prefill)):
            raise ConfigError(f"--prefill-kv-events needs --policy cache_aware and one endpoint per --prefill "
                              f"({len(self.prefill)}), got {len(events)}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be console or json, got {self.log_format!r}")
        for name in ("request_timeout_s", "connect_timeout_s", "health_check_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.role_poll_interval_s < 0:
            raise ConfigError(f"role_poll_interval_s must be >= 0, got {self.role_poll_interval_s}")
        if self.health_check_interval_s < 0:
            raise ConfigError(f"health_check_interval_s must be >= 0, got {self.health_check_interval_s}")
        if self.retry_max_retries < 0:
            raise ConfigError(f"retry_max_retries must be >= 0, got {self.retry_max_retries}")
        for name in ("max_body_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        check_shutdown_timeout(self.shutdown_timeout_s)

    @property
    def health_checks_enabled(self) -> bool:
        """False when `health_check_interval_s` is 0: every server counts as healthy."""
        return self.health_check_interval_s > 0
