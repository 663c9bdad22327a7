"""Admission under load: whether a server refuses a new generate request at once (429) because too
many requests wait, or because every live DP worker's KV cache is fuller than its limit.

Pure: it reads the controller's `WorkerState`s and answers now; nothing here waits or queues.
A request counts as waiting from the moment the front dispatched it until its worker reports it
running: per worker, the requests the front has outstanding there less those the worker's last
load report (StatsMsg, every 0.5 s) counted as running. On a decode that includes requests whose
KV is still on its way.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.dp.protocol import WorkerState

RETRY_AFTER_S = 1  # the 429's Retry-After: a worker reports its load every 0.5 s
TOO_MANY_WAITING_CODE = "too_many_waiting_requests"
KV_CACHE_FULL_CODE = "kv_cache_over_limit"


@dataclass(frozen=True)
class Overload:
    """Why a request is refused: the error's message and code."""

    message: str
    code: str


def num_waiting_requests(states: list[WorkerState]) -> int:
    """Requests dispatched to the workers and not running at their last report."""
    return sum(max(s.num_outstanding_requests - s.num_running, 0) for s in states)


def kv_usage(state: WorkerState) -> float:
    """The fraction of a worker's KV blocks not free (1 - free/total)."""
    return 1.0 - state.num_free_blocks / state.num_total_blocks


def overload(states: list[WorkerState], max_waiting_requests: int, max_kv_usage: float) -> Overload | None:
    """The reason to refuse a new request now, or None. `max_waiting_requests` 0 and `max_kv_usage`
    1.0 turn each check off. Only live workers that have reported their cache count for the KV
    check; with none, the request is left to the dispatcher (its own 503)."""
    if max_waiting_requests:
        waiting = num_waiting_requests(states)
        if waiting >= max_waiting_requests:
            return Overload(f"the server has {waiting} requests waiting, its limit (--max-waiting-requests "
                            f"{max_waiting_requests}): retry later", TOO_MANY_WAITING_CODE)
    live = [s for s in states if s.alive and s.ready and s.num_total_blocks > 0]
    if max_kv_usage < 1.0 and live and all(kv_usage(s) > max_kv_usage for s in live):
        least = min(kv_usage(s) for s in live)
        return Overload(f"the KV cache of every DP worker is more than {max_kv_usage:.0%} used (the least: "
                        f"{least:.0%}), its limit (--max-kv-usage {max_kv_usage:g}): retry later", KV_CACHE_FULL_CODE)
    return None
