"""The P/D servers' configuration: what prefill and decode workers share (the transfer backend, the
KV control plane, the cluster secret), what only a prefill uses (PrefillConfig: its registry,
its deadlines) and what only a decode uses (DecodeConfig: its deadlines, the registries it may
name, its local-prefill limit). A server holds all three, so a worker that changes role at run time
finds the other side's settings where they always were; each setting is declared once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from disagg import host_patterns
from disagg.config import (
    CLUSTER_SECRET_HELP, INSECURE_HELP, Choice, ConfigError, DisaggregationMode, ServerConfig, check_secret,
    cluster_secret, force_query_prefill_dp_rank, refuse_open_binds,
)


class TransferBackend(Choice):
    """How a P/D pair's KV moves between worker processes (kvtransfer's loopback backend joins
    endpoints of one process only: tests, never a server)."""

    NIXL = "nixl"  # NIXL agents over UCX: RDMA or NVLink on GPUs, shared memory or TCP on CPUs
    TCP = "tcp"  # plain sockets and threads, always available


# --kv-checksum's pieces on tcp: each digested from cache right after it is sent, and by the decode as it
# lands; with 2 MiB both digests cost about 10% of a whole unchecked write, against 24-35% one after the
# other (docs/benchmarks.md, "Digests while the pieces move").
TCP_CHECKSUM_PIECE_BYTES = 2 << 20


def default_checksum_piece_bytes(backend: str) -> int:
    """--kv-checksum-piece-bytes unset: 2 MiB on tcp, whole writes (0) elsewhere."""
    return TCP_CHECKSUM_PIECE_BYTES if backend == TransferBackend.TCP else 0


def check_positive(config: object, *names: str) -> None:
    for name in names:
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(config, name)}")


@dataclass(frozen=True)
class PrefillConfig:
    """A prefill server's own: its bootstrap registry and how long its rooms and leases wait."""

    bootstrap_host: str = field(default="127.0.0.1", metadata={"help": "prefill: the bootstrap registry's address"})
    bootstrap_port: int = field(default=8998, metadata={"help": "prefill: the bootstrap registry's port"})
    bootstrap_timeout_s: float = field(
        default=300.0, metadata={"help": "prefill: how long a request waits for its decode's destination blocks"})
    transfer_timeout_s: float = field(
        default=60.0, metadata={"help": "prefill: how long a room's blocks may take to land once the destination "
                                        "is known, and how long a failed room's posted writes may take to settle"})
    kv_lease_s: float = field(
        default=30.0, metadata={"help": "prefill, pull flow: how long a finished request's blocks wait for a decode "
                                        "to claim them (a claimed lease lasts until released or the decode is lost)"})
    registry_refresh_s: float = field(
        default=5.0, metadata={"help": "prefill: re-register each rank this often, so a restarted registry learns the topology again"})
    external_registry: bool = field(default=False, metadata={"negatable": False, "help": (
        "prefill: register with the bootstrap registry at --bootstrap-host:--bootstrap-port (`disagg bootstrap`, "
        "in another process or host) instead of running one in this server")})

    def __post_init__(self) -> None:
        check_positive(self, "bootstrap_timeout_s", "transfer_timeout_s", "kv_lease_s", "registry_refresh_s")


@dataclass(frozen=True)
class DecodeConfig:
    """A decode server's own: how long its requests wait, which registries they may name, how many
    registry clients stay open, and the prompts it prefills itself (a router reads that limit from
    its /server_info)."""

    waiting_timeout_s: float = field(default=300.0, metadata={"help": "decode: how long a request waits for its KV"})
    abort_ack_timeout_s: float = field(
        default=10.0, metadata={"help": "decode: how long an aborted room waits for the prefill to confirm it stopped "
                                        "writing before that prefill is declared lost (its blocks stay quarantined meanwhile)"})
    allowed_bootstrap_hosts: tuple[str, ...] = field(
        default=(), metadata={"help": "decode: the only registries (bootstrap_host:bootstrap_port) and prefill "
                                      "control addresses (a ticket's remote_host:remote_port) a request may name, "
                                      "comma-separated: host, host:port, CIDR (10.0.0.0/8), [IPv6]:port; '*' matches "
                                      "within one label of a name; without a port every port; no DNS resolution "
                                      "(default: any, as SGLang)"})
    max_bootstrap_clients: int = field(
        default=64, metadata={"help": "decode: registries whose clients (and topologies) stay open; beyond this the "
                                      "least recently used one with no request in flight is closed"})
    max_local_prefill_tokens: int = field(
        default=0, metadata={"help": "decode: prefill a request sent here alone (no bootstrap fields, no ticket) "
                                     "when at most this many of its prompt tokens are not in this decode's prefix "
                                     "cache (llm-d's nonCachedTokens rule); 0: never, such a request is refused. "
                                     "Our router reads it from /server_info and sends such requests alone"})
    whole_max_num_seqs: int = field(
        default=0, metadata={"help": "decode: while it gets requests sent whole (no prefill serves: our router marks "
                                     "them disagg_prefill_here), it schedules as a unified server: this many requests "
                                     "at once and no --max-prefill-tokens-per-step; a request with KV from a prefill "
                                     "restores its own limits (0: its --max-num-seqs)"})

    itl_objective_ms: float = field(
        default=0.0, metadata={"help": "decode: keep each step within this many ms: a request whose KV landed starts "
                                       "(and sends its first token) only while fewer run than the engine's own steps "
                                       "predict within it (at most --max-num-seqs), and requests sent whole start "
                                       "likewise (at most --whole-max-num-seqs); 0: off, the default (disagg serve: "
                                       "its planner's --itl-slo-ms); docs/protocol.md"})

    def __post_init__(self) -> None:
        check_positive(self, "waiting_timeout_s", "abort_ack_timeout_s")
        if self.itl_objective_ms < 0:
            raise ConfigError(f"itl_objective_ms must be >= 0 (0: off), got {self.itl_objective_ms}")
        if self.max_bootstrap_clients < 1:
            raise ConfigError(f"max_bootstrap_clients must be at least 1, got {self.max_bootstrap_clients}")
        if self.max_local_prefill_tokens < 0:
            raise ConfigError(f"max_local_prefill_tokens must be >= 0 (0: off), got {self.max_local_prefill_tokens}")
        if self.whole_max_num_seqs < 0:
            raise ConfigError(f"whole_max_num_seqs must be >= 0 (0: --max-num-seqs), got {self.whole_max_num_seqs}")
        object.__setattr__(self, "allowed_bootstrap_hosts", tuple(self.allowed_bootstrap_hosts))
        try:
            host_patterns.parse_patterns(self.allowed_bootstrap_hosts)
        except host_patterns.InvalidPattern as exc:
            raise ConfigError(str(exc)) from None

    def allows_bootstrap_address(self, host: str, port: int | None) -> bool:
        """True when a request may name `host`:`port` (a registry, or a ticket's prefill) under
        `allowed_bootstrap_hosts` (anything when the list is empty)."""
        return host_patterns.allows(host_patterns.parse_patterns(self.allowed_bootstrap_hosts), host, port)


@dataclass(frozen=True)
class DisaggConfig:
    """What a P/D server's workers need: what both sides share (backend, control plane, secret) and
    each side's own settings (`prefill`, `decode`)."""

    transfer_backend: TransferBackend = field(default=TransferBackend.NIXL, metadata={"help": "KV transfer backend: nixl or tcp"})
    rank_host: str = field(default="127.0.0.1", metadata={"help": "address this worker's KV control and transfer endpoints bind"})
    force_query_prefill_dp_rank: bool = field(
        default_factory=lambda: force_query_prefill_dp_rank(),
        metadata={"help": "always resolve the prefill DP rank through the registry (env DISAGG_FORCE_QUERY_PREFILL_DP_RANK)"},
    )
    control: ControlConfig = field(default_factory=lambda: ControlConfig())
    tcp_listener: TcpListenerConfig = field(default_factory=lambda: TcpListenerConfig())
    cluster_secret: str | None = field(
        default_factory=lambda: cluster_secret(), repr=False, metadata={"help": CLUSTER_SECRET_HELP})
    insecure_no_cluster_secret: bool = field(default=False, metadata={"help": INSECURE_HELP, "negatable": False})
    kv_checksum: bool = field(default=False, metadata={"help": (
        "both sides: the prefill digests the KV blocks it writes (xxh3), the decode digests what landed "
        "before the request's first token; a mismatch fails the request (503 kv_checksum_mismatch) and "
        "frees its blocks on both sides (push and pull flows, any TP sizes, CPU memory; docs/transfer.md)")})
    kv_checksum_piece_bytes: int | None = field(default=None, metadata={"help": (
        "with --kv-checksum (prefill): a write goes in pieces of about this many bytes (whole blocks), each "
        "digested while the next moves, by the prefill once posted and by the decode once landed; 0: whole "
        "writes (default: 2 MiB on tcp; whole on nixl, where a write costs ~0.1 ms of its own on a CPU)")})
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        TransferBackend.coerce_field(self, "transfer_backend")
        check_secret("cluster_secret", self.cluster_secret)
        if self.kv_checksum_piece_bytes is not None and self.kv_checksum_piece_bytes < 0:
            raise ConfigError("kv_checksum_piece_bytes must be >= 0 (0: whole writes), "
                              f"got {self.kv_checksum_piece_bytes}")

    @property
    def checksum_piece_bytes(self) -> int:
        """--kv-checksum's piece size on this backend (0: whole writes; docs/transfer.md)."""
        if self.kv_checksum_piece_bytes is not None:
            return self.kv_checksum_piece_bytes
        return default_checksum_piece_bytes(self.transfer_backend)


def check_cluster_secret(server: ServerConfig, disagg: DisaggConfig) -> None:
    """ConfigError when a prefill or decode server binds a non-loopback address (its HTTP front, its
    workers' KV control and transfer endpoints, a prefill's bootstrap registry) with neither a cluster
    secret nor `insecure_no_cluster_secret`. A unified server has no internal planes: never refused."""
    mode = server.disaggregation_mode
    if mode is DisaggregationMode.NULL:
        return
    binds = {"--host": server.host, "--rank-host": disagg.rank_host}
    if (mode is DisaggregationMode.PREFILL or server.enable_pd_role_switch) and not disagg.prefill.external_registry:
        binds["--bootstrap-host"] = disagg.prefill.bootstrap_host  # a switchable decode runs one too
    refuse_open_binds(mode.value, binds, disagg.cluster_secret, disagg.insecure_no_cluster_secret)


@dataclass(frozen=True)
class ControlConfig:
    """The gRPC KV control plane between a decode worker and a prefill worker."""

    connect_timeout_s: float = field(
        default=10.0, metadata={"help": "limit for reaching the prefill worker and registering"}
    )
    heartbeat_interval_s: float = field(default=1.0, metadata={"help": "seconds between heartbeats"})
    heartbeat_max_misses: int = field(
        default=3, metadata={"help": "unanswered heartbeats in a row before the prefill counts as lost"}
    )
    close_grace_s: float = field(default=1.0, metadata={"help": "grace period for open streams on close"})
    max_message_bytes: int = field(default=16 << 20, metadata={"help": "largest control message"})
    challenge_ttl_s: float = field(
        default=10.0, metadata={"help": "prefill: how long a nonce from the Challenge call may be answered (once)"})

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "heartbeat_interval_s", "max_message_bytes", "challenge_ttl_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heartbeat_max_misses < 1:
            raise ConfigError(f"heartbeat_max_misses must be at least 1, got {self.heartbeat_max_misses}")
        if self.close_grace_s < 0:
            raise ConfigError(f"close_grace_s must be >= 0, got {self.close_grace_s}")


@dataclass(frozen=True)
class TcpListenerConfig:
    """The tcp KV backend's listener before a connecting peer passed the handshake (its cluster secret
    challenge): how many such connections it holds, and for how long."""

    max_pending_connections: int = field(
        default=16, metadata={"help": "tcp KV listener: connections still in the handshake, at most; more are "
                                      "closed at once"})
    handshake_timeout_s: float = field(
        default=10.0, metadata={"help": "tcp KV listener: a connection not through the handshake by then is closed"})

    def __post_init__(self) -> None:
        if self.max_pending_connections < 1:
            raise ConfigError(f"max_pending_connections must be at least 1, got {self.max_pending_connections}")
        if self.handshake_timeout_s <= 0:
            raise ConfigError(f"handshake_timeout_s must be positive, got {self.handshake_timeout_s}")


def with_settings(config: DisaggConfig, **settings) -> DisaggConfig:
    """`config` with settings given by their flat names, as on the command line (`waiting_timeout_s`
    for `--waiting-timeout-s`), each replaced in the part that declares it; an unknown name is a
    ConfigError."""
    parts = {"prefill": PrefillConfig, "decode": DecodeConfig}
    own = {f.name for f in fields(DisaggConfig)}
    changes = {name: value for name, value in settings.items() if name in own}
    for part, cls in parts.items():
        mine = {f.name: settings[f.name] for f in fields(cls) if f.name in settings}
        if mine:
            changes[part] = replace(changes.get(part, getattr(config, part)), **mine)
    unknown = sorted(set(settings) - own - {f.name for cls in parts.values() for f in fields(cls)})
    if unknown:
        raise ConfigError(f"unknown P/D settings: {', '.join(unknown)}")
    return replace(config, **changes)
