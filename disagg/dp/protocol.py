"""What the HTTP layer needs from the DP controller (and what tests may fake in-process)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from disagg.config import DisaggregationMode, LoadBalanceMethod
from disagg.types import FaultKind
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg, PdStatsMsg, StepsMsg, Utility

if TYPE_CHECKING:
    from disagg.dp.role_switch import PdRoles
    from disagg.http_edge import HttpError


class WorkerUnavailable(RuntimeError):
    """A DP worker died or is not ready; requests routed to it fail with 503."""


class InconsistentUtilityResults(RuntimeError):
    """DP workers disagree on a utility call's answer; `results` lists every worker's value."""

    def __init__(self, method: str, results: list[object]):
        listed = ", ".join(f"dp_rank {i}: {r!r}" for i, r in enumerate(results))
        super().__init__(f"{method}: DP workers disagree ({listed})")
        self.method = method
        self.results = results


class UtilityFailed(RuntimeError):
    """A utility call failed on some workers; `failures` maps dp_rank to the error text."""

    def __init__(self, method: str, failures: dict[int, str]):
        listed = ", ".join(f"dp_rank {r}: {e}" for r, e in sorted(failures.items()))
        text = f"{method} failed on {len(failures)} DP worker(s) ({listed})" if failures else f"{method}: there are no DP workers"
        super().__init__(text)
        self.method = method
        self.failures = failures


@dataclass(frozen=True)
class ModelCard:
    name: str
    max_model_len: int
    vocab_size: int
    engine_summary: str = ""  # dtype and matmul kernels the workers chose, and why
    compatibility: dict = field(default_factory=dict)  # what a P/D peer must share (the workers' ReadyMsg)
    cache_info: dict = field(default_factory=dict)  # vLLM's cache_config_info labels (CacheConfig.metrics_info)
    eos_token_ids: tuple[int, ...] = ()  # the tokens that end a sequence


@dataclass(frozen=True)
class WorkerState:
    dp_rank: int
    alive: bool
    ready: bool
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_outstanding_requests: int
    num_restarts: int = 0  # how many times this rank's worker was restarted after dying
    num_quarantined_blocks: int = 0  # KV blocks held until no remote write can land (fencing)
    block_size: int = 0  # tokens per KV block (0 until the worker is ready)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since the worker started
    prefix_cache_hits: int = 0  # of them, found cached
    num_waiting_deferred: int = 0  # waiting on something other than room: a decode's requests whose KV is on its way
    pd: PdStatsMsg | None = None  # a prefill's or decode's queues and failed requests


@dataclass(frozen=True)
class DispatchStats:
    """The controller's cache_aware picks so far: a tree matched enough of the prompt, or not."""

    num_cache_hits: int = 0
    num_cache_misses: int = 0


class EngineClient(Protocol):
    dp_size: int
    load_balance_method: LoadBalanceMethod
    model: ModelCard
    role_info: dict  # what /server_info says of the workers' role (RoleSpec.info, the role epoch)
    mode: DisaggregationMode  # the role the server plays now (a role switch changes it)
    pd_roles: PdRoles | None  # --enable-pd-role-switch: the role now, the other, the switch state

    def pick_rank(self, routed_dp_rank: int | None, bootstrap_room: int | None, msg: GenerateMsg | None = None) -> int:
        """Choose the DP worker (`msg`: the request, whose prompt cache_aware matches);
        raises InvalidRequest for a bad rank or a missing room."""

    def dispatch_stats(self) -> DispatchStats:
        """Cache hits and misses of the cache_aware picks (for /metrics)."""

    def generate(self, msg: GenerateMsg, dp_rank: int) -> AsyncIterator[OutputMsg]:
        """Stream a request's outputs; closing the iterator early aborts the request."""

    async def abort(self, request_id: str) -> bool:
        """Abort wherever it runs; True if it was found."""

    async def call_utility(self, method: Utility, *args, ranks: list[int] | None = None) -> list[object]:
        """Run on every worker (or on `ranks`); one result per worker called. Raises UtilityFailed,
        WorkerUnavailable."""

    async def inject_fault(self, kind: FaultKind, dp_rank: int, params: dict) -> None:
        """A fault on one worker, on purpose (--enable-fault-injection; disagg/dp/faults.py)."""

    async def switch_role(self, new_mode: DisaggregationMode, timeout_s: float,
                          in_flight: Callable[[], int] | None = None,
                          hand_back: Callable[[HttpError], Awaitable[int]] | None = None) -> bool:
        """Switch the whole server to `new_mode` once `in_flight` reads 0 and no worker holds anything
        (RoleSwitchError when it cannot); False when it runs it already. Leaving the decode role, the
        requests that sent nothing yet are first handed back (`hand_back`: ended with the switch's 503)."""

    def take_step_reports(self) -> list[StepsMsg]:
        """The workers' per-step engine metrics since the last call (for /metrics)."""

    async def refresh_stats(self) -> None:
        """Ask the workers for their load now, so `worker_states()` is current (for /metrics); a
        worker busy past a short deadline keeps its last report."""

    def worker_states(self) -> list[WorkerState]:
        """One entry per DP worker (for /server_info, /metrics, /health)."""

    def healthy(self) -> bool:
        """Every worker alive and ready."""
