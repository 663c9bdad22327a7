"""The bootstrap registry's configs: its HTTP server, the client prefill and decode workers use, and
the retry backoff both calls and discovery share. Frozen; the cluster secret comes from config.py."""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.config import INSECURE_HELP, ConfigError, check_secret, cluster_secret, refuse_open_binds


@dataclass(frozen=True)
class RetryConfig:
    """Exponential backoff between the attempts of one call; the call's own deadline bounds the total."""

    initial_backoff_s: float = field(default=0.05, metadata={"help": "first wait between retries"})
    max_backoff_s: float = field(default=1.0, metadata={"help": "longest wait between retries"})
    multiplier: float = field(default=2.0, metadata={"help": "growth of the wait per attempt"})

    def __post_init__(self) -> None:
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ConfigError(
                f"need 0 < initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s}, {self.max_backoff_s}"
            )
        if self.multiplier < 1.0:
            raise ConfigError(f"multiplier must be at least 1.0, got {self.multiplier}")

    def backoff_s(self, attempt: int) -> float:
        """Wait before retry number `attempt` (0-based): initial * multiplier**attempt, capped."""
        return min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** min(attempt, 64))


@dataclass(frozen=True)
class BootstrapConfig:
    """The bootstrap registry's HTTP server (hosted by a prefill server, or standalone)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address the bootstrap server binds"})
    port: int = field(default=8998, metadata={"help": "bootstrap server port (0: any free port)"})
    room_ttl_s: float = field(
        default=120.0, metadata={"help": "seconds a registered room -> prefill DP rank entry lives"}
    )
    max_rooms: int = field(
        default=100_000, metadata={"help": "live room -> prefill DP rank entries held; a new room beyond them (after "
                                           "expired ones are dropped) is refused with 429"})
    max_ranks: int = field(
        default=4096,
        metadata={"help": "largest topology (dp_size * tp_size * pp_size * cp_size) a prefill may register"})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "largest accepted request body"})
    challenge_ttl_s: float = field(
        default=10.0, metadata={"help": "how long a nonce from GET /challenge may be answered (once) by a write"})
    cluster_secret: str | None = field(
        default_factory=lambda: cluster_secret(), repr=False,
        metadata={"help": "require a proof of SECRET (an answer to GET /challenge) on PUT /route and "
                          "POST /register_dp_rank (env DISAGG_CLUSTER_SECRET; reads stay open; refused on a "
                          "non-loopback --host without --insecure-no-cluster-secret)"})
    insecure_no_cluster_secret: bool = field(default=False, metadata={"help": INSECURE_HELP, "negatable": False})

    def __post_init__(self) -> None:
        check_secret("cluster_secret", self.cluster_secret)
        refuse_open_binds("bootstrap", {"--host": self.host}, self.cluster_secret, self.insecure_no_cluster_secret)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.room_ttl_s <= 0:
            raise ConfigError(f"room_ttl_s must be positive, got {self.room_ttl_s}")
        for name in ("max_body_bytes", "max_rooms", "max_ranks"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.challenge_ttl_s <= 0:
            raise ConfigError(f"challenge_ttl_s must be positive, got {self.challenge_ttl_s}")


@dataclass(frozen=True)
class BootstrapClientConfig:
    """How prefill and decode workers talk to a bootstrap server."""

    request_timeout_s: float = field(default=5.0, metadata={"help": "limit of one HTTP attempt"})
    deadline_s: float = field(
        default=30.0, metadata={"help": "default limit of one call, retries included"}
    )
    query_batch_window_s: float = field(
        default=0.002, metadata={"help": "room queries arriving within this window share one POST"}
    )
    retry: RetryConfig = field(default_factory=RetryConfig)

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "deadline_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.query_batch_window_s < 0:
            raise ConfigError(f"query_batch_window_s must be >= 0, got {self.query_batch_window_s}")
