"""Admission under load: whether a server refuses a new generate request at once (429) because too
many requests wait, because every live DP worker's KV cache is fuller than its limit, or because the
requests it answered lately all waited past the TTFT objective for their first token while others still wait.

Pure: it reads the controller's `WorkerState`s and the waits the front measured (`FirstTokenWaits`,
the clock passed in) and answers now; nothing here waits or queues.
A request counts as waiting from the moment the front dispatched it until its worker reports it
running: per worker, the requests the front has outstanding there less those the worker's last
load report (StatsMsg, every 0.5 s) counted as running. On a decode that includes requests whose
KV is still on its way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from disagg.dp.protocol import WorkerState

RETRY_AFTER_S = 1  # the 429's Retry-After: a worker reports its load every 0.5 s
TOO_MANY_WAITING_CODE = "too_many_waiting_requests"
KV_CACHE_FULL_CODE = "kv_cache_over_limit"
TTFT_OVER_OBJECTIVE_CODE = "ttft_over_objective"
# The first tokens that say what a new request would wait: the last MAX_WAITS given within WAIT_WINDOW_S, if
# at least MIN_WAITS (fewer: too light a load to tell a queue from a long prompt's own compute). The latest
# few, not all of a window: a server past capacity answers slowly, and a queue must show in a few answers.
# Only while a request has waited half the objective already: a queue stands now. The quickest of them, not
# the median, must be past the objective (CoDel's test of a standing queue): a burst at a light load (a
# document's prompt or two) leaves some answers quick, and a 429 there costs more than a late first token.
WAIT_WINDOW_S = 10.0
MAX_WAITS = 5
MIN_WAITS = 3


@dataclass(frozen=True)
class Overload:
    """Why a request is refused: the error's message and code."""

    message: str
    code: str


class FirstTokenWaits:
    """How long this server's requests waited for their first output (dispatch to the first token, the
    server's own TTFT: on a decode the KV's way included). Times are monotonic seconds, passed in."""

    def __init__(self, window_s: float = WAIT_WINDOW_S, max_waits: int = MAX_WAITS):
        self.window_s = window_s
        self._waiting: dict[str, float] = {}  # request id -> when it was dispatched, until its first output
        self._answered: deque[tuple[float, float]] = deque(maxlen=max_waits)  # (when its first output came, its wait)

    def dispatched(self, request_id: str, now: float) -> None:
        self._waiting[request_id] = now

    def answered(self, request_id: str, now: float) -> None:
        """`request_id`'s first output came (once per request: later calls are no-ops)."""
        since = self._waiting.pop(request_id, None)
        if since is not None:
            self._answered.append((now, now - since))

    def dropped(self, request_id: str) -> None:
        """`request_id` ended, answered or not."""
        self._waiting.pop(request_id, None)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def longest_wait_s(self, now: float) -> float:
        """How long the request waiting longest has waited so far (0.0: none waits)."""
        return now - next(iter(self._waiting.values()), now)  # dispatch order: the first is the oldest

    def recent_waits_s(self, now: float) -> list[float]:
        """The waits of the latest first outputs (at most `max_waits`) of the last `window_s`, oldest first."""
        while self._answered and self._answered[0][0] < now - self.window_s:
            self._answered.popleft()
        return [wait for _, wait in self._answered]


def ttft_overload(waits: FirstTokenWaits, ttft_objective_ms: float, now: float) -> Overload | None:
    """Refuse while every one of the latest first outputs (`recent_waits_s`, at least MIN_WAITS of them)
    waited past the objective and a request has waited half of it already: a queue stands that a new
    request would wait behind, so it would miss it too, and its work would slow those that can still meet
    it. Once none has waited so long (the queue cleared: a request just taken does not hold the door shut
    on the next), or too few were answered lately, requests are taken again."""
    if not ttft_objective_ms or (longest_s := waits.longest_wait_s(now)) * 1e3 < ttft_objective_ms / 2:
        return None
    recent = waits.recent_waits_s(now)
    if len(recent) < MIN_WAITS or (quickest_s := min(recent)) * 1e3 <= ttft_objective_ms:
        return None
    return Overload(f"the server's requests waited at least {quickest_s * 1e3:.0f} ms for their first token lately "
                    f"(the last {len(recent)} answered in {waits.window_s:g} s; {waits.num_waiting} waiting "
                    f"now, the longest for {longest_s * 1e3:.0f} ms), past its objective (--ttft-objective-ms "
                    f"{ttft_objective_ms:g}): retry later", TTFT_OVER_OBJECTIVE_CODE)


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
