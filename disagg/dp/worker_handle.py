"""The front's handle on one DP worker process (`WorkerHandle`: its connection, readiness, load,
reported state and restarts with their backoff), on one request sent through it (`SentRequest`: what a
migration resends) and the id a worker knows a request by (`engine_msg`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

import msgspec

from disagg.config import ServerConfig
from disagg.dp.protocol import WorkerState, WorkerUnavailable
from disagg.wire.engine_msgs import GenerateMsg, ReadyMsg, StatsMsg, encode
from disagg.wire.framing import frame


class WorkerHandle:
    """One incarnation of the worker of a DP rank; a restart makes a new one."""

    def __init__(self, rank: int, process, num_restarts: int = 0, down_reason: str | None = None):
        self.rank = rank
        self.process = process
        self.writer: asyncio.StreamWriter | None = None
        self.ready: ReadyMsg | None = None
        self.ready_at: float | None = None
        self.alive = True
        self.stats = StatsMsg(0, 0, 0, 0)
        self.outstanding: dict[str, int] = {}  # request id -> estimated tokens
        self.num_restarts = num_restarts
        self.down_reason = down_reason  # why the previous incarnation is gone (None: first start)
        self.num_quick_deaths = 0  # deaths in a row of incarnations that did not stay up long

    @property
    def available(self) -> bool:
        return self.alive and self.ready is not None

    def send(self, msg) -> None:
        if not self.available or self.writer is None:
            raise WorkerUnavailable(self.unavailable_reason())
        self.writer.write(frame(encode(msg)))

    def state(self) -> WorkerState:
        """What the front reports of this worker (its last stats, its requests in flight)."""
        stats, ready = self.stats, self.ready
        return WorkerState(self.rank, self.alive, ready is not None, stats.num_running, stats.num_waiting,
                           stats.num_free_blocks, stats.num_total_blocks, len(self.outstanding), self.num_restarts,
                           stats.num_quarantined_blocks, ready.block_size if ready is not None else 0,
                           stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_waiting_deferred, stats.pd)

    def restart_backoff_s(self, server: ServerConfig) -> tuple[float, int]:
        """The wait before restarting this (dead) worker, and the quick-death count it implies: the backoff
        doubles per death of a worker that was not up for `worker_restart_max_backoff_s`."""
        lived_s = 0.0 if self.ready_at is None else time.monotonic() - self.ready_at
        quick = 0 if lived_s >= server.worker_restart_max_backoff_s else self.num_quick_deaths + 1
        return min(server.worker_restart_backoff_s * 2 ** max(quick - 1, 0), server.worker_restart_max_backoff_s), quick

    def unavailable_reason(self) -> str:
        if not self.alive:
            return f"DP worker {self.rank} is not available: it died ({self.down_reason}); a restart is scheduled"
        if self.down_reason is not None:
            return f"DP worker {self.rank} is not available: it is restarting after it died ({self.down_reason})"
        return f"DP worker {self.rank} is not available: it is not ready yet"


@dataclass
class SentRequest:
    """A request on its way through a worker: which one, and the tokens it streamed so far."""

    msg: GenerateMsg
    worker: WorkerHandle
    token_ids: list[int] = field(default_factory=list)
    num_migrations: int = 0

    def resumed(self) -> GenerateMsg:
        """The request as another worker takes it over: the tokens streamed so far go with it; what
        its first answer carried (the prompt, its logprobs) went out already when any token did."""
        if not self.token_ids:
            return self.msg
        sampling = replace(self.msg.sampling, prompt_logprobs=None)
        return msgspec.structs.replace(self.msg, resume_token_ids=list(self.token_ids), return_prompt=False,
                                       sampling=sampling)


def engine_msg(msg: GenerateMsg, number: int) -> GenerateMsg:
    """`msg` under the id its worker knows it by: the client's id and the front's `number` for this
    dispatch (`<id>-<number>`), unique however often a client or a router's retry reuses the id. A
    worker's log lines, its KV transfers and a pull ticket's `remote_request_id` carry it."""
    return msgspec.structs.replace(msg, request_id=f"{msg.request_id}-{number}")
