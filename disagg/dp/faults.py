"""Fault injection on a server's DP workers (`--enable-fault-injection`, docs/testing.md), the
front's side: which faults exist and their parameters, and the three that act here.

- `stall` (seconds): SIGSTOP on the worker's process, SIGCONT after; it answers nothing meanwhile
  (requests, control streams, heartbeats), as a hung process would.
- `kill`: SIGKILL; the controller notices and restarts it as it does any dead worker.
- `fail_requests` (count, status): the next `count` requests sent to that rank answer `status`.
- Sent to the worker (a utility call: disagg/worker/unified.py, the transfer ones disagg/worker/transfer.py): `slow_steps` (ms before each
  engine step; 0 ends it), `delay_transfers` (count, seconds), `fail_transfers` (count),
  `stop_heartbeats` (seconds).
"""

from __future__ import annotations

import asyncio
import os
import signal

from disagg.types import FaultKind, InvalidRequest

FAULTS: dict[FaultKind, tuple[str, ...]] = {  # each fault's parameters
    FaultKind.STALL: ("seconds",), FaultKind.KILL: (), FaultKind.FAIL_REQUESTS: ("count", "status"),
    FaultKind.SLOW_STEPS: ("ms",), FaultKind.DELAY_TRANSFERS: ("count", "seconds"), FaultKind.FAIL_TRANSFERS: ("count",),
    FaultKind.CORRUPT_TRANSFERS: ("count",),
    FaultKind.STOP_HEARTBEATS: ("seconds",),
}
# The faults the worker applies (a utility call), and those only prefill and decode workers take.
PD_FAULTS = frozenset({FaultKind.DELAY_TRANSFERS, FaultKind.FAIL_TRANSFERS, FaultKind.STOP_HEARTBEATS,
                       FaultKind.CORRUPT_TRANSFERS})
WORKER_FAULTS = PD_FAULTS | {FaultKind.SLOW_STEPS}
_LIMITS = {"seconds": (0.001, 3600.0), "count": (1, 1_000_000), "ms": (0.0, 60_000.0)}
ENGINE_STATUSES = (400, 404, 413, 429, 500, 503)  # what a worker's failed request may answer (api/errors.py)


def check_fault(name: str, params: dict[str, object]) -> tuple[FaultKind, dict[str, float | int]]:
    """The fault named `name` and its parameters, checked: InvalidRequest naming what is wrong."""
    try:
        kind = FaultKind(name)
    except ValueError:
        raise InvalidRequest(f"unknown fault {name!r}: one of {', '.join(FAULTS)}", "fault") from None
    return kind, {param: _checked(kind, param, params.get(param)) for param in FAULTS[kind]}


def _checked(kind: FaultKind, name: str, value: object) -> float | int:
    if name == "status":
        if isinstance(value, bool) or value not in ENGINE_STATUSES:
            raise InvalidRequest(f"{kind} needs status: one of {', '.join(map(str, ENGINE_STATUSES))}, got {value!r}", name)
        return value
    low, high = _LIMITS[name]
    integral = isinstance(low, int)
    if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)) or not low <= value <= high:
        raise InvalidRequest(f"{kind} needs {name}: {'an integer' if integral else 'a number'} in [{low}, {high}], "
                             f"got {value!r}", name)
    return value


class ProcessFaults:
    """The faults a controller applies itself: to a worker's process, and to the requests it sends it."""

    def __init__(self) -> None:
        self._failing: dict[int, tuple[int, int]] = {}  # rank -> (requests left to fail, status)

    def apply(self, kind: FaultKind, rank: int, pid: int | None, params: dict) -> None:
        if kind is FaultKind.FAIL_REQUESTS:
            self._failing[rank] = (params["count"], params["status"])
            return
        if pid is None:
            raise InvalidRequest(f"DP worker {rank} has no process", "dp_rank")
        if kind is FaultKind.KILL:
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            asyncio.get_running_loop().call_later(params["seconds"], _resume, pid)

    def take_failure(self, rank: int) -> int | None:
        """The status the next request on `rank` must answer, when a fail_requests fault is armed."""
        left, status = self._failing.get(rank, (0, 0))
        if not left:
            return None
        self._failing[rank] = (left - 1, status)
        return status


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # it died (or was killed) while stopped
        pass
