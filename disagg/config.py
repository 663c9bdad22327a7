"""Frozen configuration, one dataclass per component, composed per role.

Environment variables are read here and nowhere else; the engine's own configs (model, cache,
scheduler) live in disagg/engine_config.py, which reads none. Values found at run time (the model's
architecture, the number of KV blocks that fit) are returned by the component that finds them,
never written back into these objects.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
from dataclasses import dataclass, field

from disagg.tool_config import ToolConfig


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the accepted values."""


class Choice(str, enum.Enum):
    """A config field's closed set of values: a str (compares and prints as its value, as on the
    command line and in JSON) and a member of its Enum."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's value, in order (a CLI option's `choices`)."""
        return tuple(member.value for member in cls)

    @classmethod
    def parse(cls, name: str, value: str) -> Choice:
        """The member for `value`; ConfigError naming the field `name` and the values it takes."""
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{name} must be one of {', '.join(cls.values())}, got {value!r}") from None

    @classmethod
    def coerce_field(cls, config, name: str) -> None:
        """In a frozen config's __post_init__: its field `name` (a str or a member) becomes the member."""
        object.__setattr__(config, name, cls.parse(name, getattr(config, name)))


def replace(obj, **changes):
    """dataclasses.replace, re-exported so callers need one import for config work."""
    return dataclasses.replace(obj, **changes)


def env_flag(name: str, environ: dict[str, str] | None = None) -> bool:
    """True when the environment variable is set to 1/true/yes/on (case-insensitive)."""
    value = (environ if environ is not None else os.environ).get(name, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def force_query_prefill_dp_rank(environ: dict[str, str] | None = None) -> bool:
    """DISAGG_FORCE_QUERY_PREFILL_DP_RANK: decode always asks the registry for the prefill DP rank."""
    return env_flag("DISAGG_FORCE_QUERY_PREFILL_DP_RANK", environ)


def env_secret(name: str, environ: dict[str, str] | None = None) -> str | None:
    """The environment variable's value, or None when it is unset or empty."""
    return (environ if environ is not None else os.environ).get(name) or None


def otlp_traces_endpoint(environ: dict[str, str] | None = None) -> str | None:
    """OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (OpenTelemetry's variable): where traces go when no
    --otlp-traces-endpoint is given; unset: tracing off."""
    return env_secret("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", environ)


def cluster_secret(environ: dict[str, str] | None = None) -> str | None:
    """DISAGG_CLUSTER_SECRET: the secret shared by every prefill, decode and bootstrap of one cluster."""
    return env_secret("DISAGG_CLUSTER_SECRET", environ)


def admin_key(environ: dict[str, str] | None = None) -> str | None:
    """DISAGG_ADMIN_KEY: the bearer key of a server's admin routes."""
    return env_secret("DISAGG_ADMIN_KEY", environ)


def cpu_isa(environ: dict[str, str] | None = None) -> str | None:
    """DISAGG_CPU_ISA: run as a CPU of this level would (avx512, avx2, base; disagg.ops.cpu); None when unset."""
    value = (env_secret("DISAGG_CPU_ISA", environ) or "").strip().lower() or None
    if value not in (None, "avx512", "avx2", "base"):
        raise ConfigError(f"DISAGG_CPU_ISA must be one of avx512, avx2, base, got {value!r}")
    return value


def check_secret(name: str, value: str | None) -> None:
    if value is not None and not value:
        raise ConfigError(f"{name} must not be empty (leave it unset to turn it off)")


CLUSTER_SECRET_HELP = ("shared secret authenticating the KV control stream, the tcp KV listener and bootstrap "
                        "registry writes (env DISAGG_CLUSTER_SECRET; unset: no authentication, refused on a "
                        "non-loopback address without --insecure-no-cluster-secret)")
INSECURE_HELP = ("start without a cluster secret although this process binds a non-loopback address: its KV "
                  "control plane, KV listeners and bootstrap registry writes are then open to anyone who reaches "
                  "them (SGLang's and vLLM's default; only on a network you trust)")


def is_loopback_host(host: str) -> bool:
    """True for an address of 127.0.0.0/8, ::1 or `localhost`, as written (no DNS lookup: any other
    name may resolve to a reachable address)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def refuse_open_binds(command: str, binds: dict[str, str], secret: str | None, insecure: bool) -> None:
    """ConfigError when `disagg COMMAND` would bind a non-loopback address ({flag: address} in `binds`)
    with neither a cluster secret nor the explicit opt-out: its internal planes would be open to
    anyone who reaches the ports."""
    exposed = [f"{host} ({flag})" for flag, host in binds.items() if not is_loopback_host(host)]
    if not exposed or secret is not None or insecure:
        return
    raise ConfigError(
        f"disagg {command} binds {', '.join(exposed)} without a cluster secret: anyone who reaches its ports could "
        "write bootstrap registry routes, open KV control streams and read or write KV blocks. Give every prefill, "
        "decode and bootstrap of the cluster the same secret with --cluster-secret or the environment variable "
        "DISAGG_CLUSTER_SECRET (not shown by ps), bind loopback addresses only, or pass "
        "--insecure-no-cluster-secret to run the internal planes open, as SGLang and vLLM do")


# --- HTTP front door and data-parallel workers ----------------------------------------------------

class LoadBalanceMethod(Choice):
    """How a server's DP controller picks the worker of a request (docs/api.md, "DP routing and P/D fields")."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"  # the fewest outstanding tokens
    FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"  # bootstrap_room % dp_size
    CACHE_AWARE = "cache_aware"  # the worker whose prompts share the longest prefix (disagg/prefix_tree.py)


SHUTDOWN_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_HELP = (
    "on SIGTERM/SIGINT: seconds in-flight requests get to finish before they are aborted (0: abort at once); "
    "health turns 503 and new requests get 503 meanwhile; a second signal ends the wait"
)


def check_shutdown_timeout(value: float) -> None:
    """ConfigError unless `value` (shutdown_timeout_s of a server or the router) is >= 0."""
    if value < 0:
        raise ConfigError(f"shutdown_timeout_s must be >= 0, got {value}")


@dataclass(frozen=True)
class TlsConfig:
    """HTTPS on an HTTP front (a server's or the router's), with vLLM's flag names: on when a
    certificate is given. The internal planes (registry, KV control, KV transfer) stay plain."""

    ssl_keyfile: str | None = field(default=None, metadata={"help": "private key (PEM) of --ssl-certfile"})
    ssl_certfile: str | None = field(
        default=None, metadata={"help": "certificate chain (PEM) to serve HTTPS with (unset: plain HTTP)"})
    ssl_ca_certs: str | None = field(
        default=None, metadata={"help": "CA certificates (PEM) that verify client certificates (see --ssl-cert-reqs)"})
    ssl_cert_reqs: int = field(
        default=0, metadata={"help": "client certificates, as Python's ssl.CERT_*: 0 not asked, 1 optional "
                                     "(verified when sent), 2 required; 1 and 2 need --ssl-ca-certs"})

    def __post_init__(self) -> None:
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            if getattr(self, name) == "":
                raise ConfigError(f"--{name.replace('_', '-')} must not be empty (leave it unset)")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ConfigError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {self.ssl_cert_reqs}")
        if self.ssl_certfile is None and (self.ssl_keyfile or self.ssl_ca_certs or self.ssl_cert_reqs):
            raise ConfigError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile "
                              "(without a certificate the server speaks plain HTTP)")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ConfigError(f"--ssl-cert-reqs {self.ssl_cert_reqs} needs --ssl-ca-certs: the CA certificates "
                              "that verify client certificates")

    @property
    def enabled(self) -> bool:
        """True when the front serves HTTPS."""
        return self.ssl_certfile is not None

    @property
    def scheme(self) -> str:
        """`https` or `http`: how clients reach the front."""
        return "https" if self.enabled else "http"


class DisaggregationMode(Choice):
    """A server's part: NULL runs whole requests (unified), PREFILL and DECODE the two halves."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ServerConfig:
    """One HTTP server (unified, prefill or decode) with `dp_size` engine workers behind it."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=8000, metadata={"help": "HTTP port (0: any free port)"})
    dp_size: int = field(default=1, metadata={"help": "data-parallel engine worker processes"})
    cpus: str | None = field(
        default=None, metadata={"help": "pin the DP workers to these CPUs (a Linux CPU list: 0-3,8,10-11), split among "
                                        "the ranks in contiguous runs, as even as possible (fewer CPUs than ranks: ranks "
                                        "share them, rank r on CPU r mod N); a worker's torch threads default to the "
                                        "size of its share (default: not pinned)"})
    load_balance_method: LoadBalanceMethod = field(
        default=LoadBalanceMethod.LEAST_LOAD, metadata={"help": "round_robin, least_load, follow_bootstrap_room or cache_aware "
                                                                   "(the worker that was sent the longest prefix of the prompt)"}
    )
    api_key: str | None = field(default=None, repr=False, metadata={"help": "require 'Authorization: Bearer KEY'"})
    admin_key: str | None = field(
        default_factory=lambda: admin_key(), repr=False,
        metadata={"help": "bearer key of the admin routes (abort, flush, sleep, wake_up; env DISAGG_ADMIN_KEY); "
                          "with --api-key and no admin key they answer 403"},
    )
    max_body_bytes: int = field(default=8 << 20, metadata={"help": "largest accepted request body"})
    log_format: str = field(default="console", metadata={"help": "console or json"})
    worker_start_timeout_s: float = field(default=600.0, metadata={"help": "limit for workers to load"})
    shutdown_timeout_s: float = field(default=SHUTDOWN_TIMEOUT_S,
                                      metadata={"help": SHUTDOWN_TIMEOUT_HELP, "aliases": ("--shutdown-timeout",)})
    disaggregation_mode: DisaggregationMode = field(default=DisaggregationMode.NULL,
                                                    metadata={"help": "null (unified), prefill or decode"})
    worker_restart_backoff_s: float = field(default=1.0, metadata={
        "help": "wait before restarting a dead DP worker; doubles per quick death"})
    worker_restart_max_backoff_s: float = field(default=30.0, metadata={
        "help": "longest wait before a restart; a worker up this long resets the backoff"})
    migration_limit: int = field(
        default=1, metadata={"help": "how many times a request whose DP worker died goes on on another worker of this "
                                     "server (its prompt and the tokens already streamed computed again there); 0: "
                                     "never (it ends with 503); a prefill never migrates"})
    max_waiting_requests: int = field(
        default=0, metadata={"help": "refuse a new generate request at once with 429 (Retry-After: 1) while this many "
                                     "requests wait (dispatched to a DP worker, not running yet); 0: no limit"})
    max_kv_usage: float = field(
        default=1.0, metadata={"help": "refuse a new generate request at once with 429 (Retry-After: 1) while the KV "
                                       "cache of every live DP worker is more than this fraction used; 1.0: off"})
    ttft_objective_ms: float = field(
        default=0.0, metadata={"help": "refuse a new generate request at once with 429 (Retry-After: 1) while the last "
                                       "5 answered in 10 s (at least 3) all waited more than this many ms for their "
                                       "first token and one has waited half as long for its own: a new one would "
                                       "queue behind it and miss it too; 0: off (disagg serve: its planner's "
                                       "--ttft-slo-ms)"})
    enable_pd_role_switch: bool = field(default=False, metadata={"negatable": False, "help": (
        "prefill and decode servers: POST /pd_role_switch {\"new_role\": \"prefill\"|\"decode\"} (admin) switches "
        "the whole server, every DP worker, at run time, without restarting a worker or reloading weights "
        "(SGLang's flag); the server also runs its bootstrap registry as a decode (--bootstrap-port)")})
    pd_role_switch_timeout_s: float = field(default=60.0, metadata={"help": (
        "how long a role switch waits for the work the server accepted to end (new requests get 503 "
        "role_switching meanwhile); past it the switch is refused (503) and the server goes on in its role")})
    step_metrics_endpoint: str | None = field(default=None, metadata={"help": (
        "publish each DP worker's per-step engine metrics (wall time, prefill tokens, decode sequences and "
        "their KV tokens, queue depth; twice a second) on ZMQ PUB here, tcp://HOST:PORT or ipc://PATH; DP "
        "worker r at PORT + r (default: not published; /metrics summarises them either way)")})
    enable_tokenizer_info_endpoint: bool = field(default=False, metadata={"negatable": False, "help": (
        "GET /tokenizer_info: the tokenizer's class and settings, its chat template included (vLLM's flag; off by "
        "default, as there: the template may be private)")})
    otlp_traces_endpoint: str | None = field(default_factory=lambda: otlp_traces_endpoint(), metadata={"help": (
        "send OpenTelemetry traces over OTLP/HTTP (protobuf) to this URL, e.g. http://collector:4318/v1/traces: a span "
        "per generate request, the child of the caller's traceparent (vLLM's flag; default: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off; needs the tracing extra)")})
    tls: TlsConfig = field(default_factory=TlsConfig)
    tools: ToolConfig = field(default_factory=ToolConfig)
    enable_fault_injection: bool = field(default=False, metadata={"negatable": False, "help": (
        "tests: POST /faults (admin key) makes a DP worker stall, die, fail requests or transfers (docs/testing.md)")})

    def __post_init__(self) -> None:
        if (problem := self.tools.problem()) is not None:
            raise ConfigError(problem)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.dp_size < 1:
            raise ConfigError(f"dp_size must be at least 1, got {self.dp_size}")
        LoadBalanceMethod.coerce_field(self, "load_balance_method")
        if self.log_format not in ("console", "json"):
            raise ConfigError(f"log_format must be console or json, got {self.log_format!r}")
        if not 0 < self.worker_restart_backoff_s <= self.worker_restart_max_backoff_s:
            raise ConfigError(
                "need 0 < worker_restart_backoff_s <= worker_restart_max_backoff_s, got "
                f"{self.worker_restart_backoff_s}, {self.worker_restart_max_backoff_s}"
            )
        DisaggregationMode.coerce_field(self, "disaggregation_mode")
        if self.enable_pd_role_switch and self.disaggregation_mode is DisaggregationMode.NULL:
            raise ConfigError("--enable-pd-role-switch is for prefill and decode servers, not a unified one")
        if self.step_metrics_endpoint is not None and not self.step_metrics_endpoint.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"step_metrics_endpoint must be tcp://HOST:PORT or ipc://PATH, got {self.step_metrics_endpoint!r}")
        if self.pd_role_switch_timeout_s <= 0:
            raise ConfigError(f"pd_role_switch_timeout_s must be positive, got {self.pd_role_switch_timeout_s}")
        if self.migration_limit < 0:
            raise ConfigError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.max_waiting_requests < 0:
            raise ConfigError(f"max_waiting_requests must be >= 0 (0: no limit), got {self.max_waiting_requests}")
        if self.ttft_objective_ms < 0:
            raise ConfigError(f"ttft_objective_ms must be >= 0 (0: off), got {self.ttft_objective_ms}")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ConfigError(f"max_kv_usage must be in (0, 1] (1: off), got {self.max_kv_usage}")
        check_shutdown_timeout(self.shutdown_timeout_s)
        check_secret("api_key", self.api_key)
        check_secret("admin_key", self.admin_key)
