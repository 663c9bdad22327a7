"""A P/D server's role at run time (`--enable-pd-role-switch`, SGLang's `POST /pd_role_switch`).

`PdRoles` is what the front knows: the mode it serves now, its epoch (one more per switch), the worker
role and DP load-balance method of each mode, and whether it is serving, switching or failed.
`switch_role` moves a whole server, every DP worker, without restarting a worker or reloading a
weight: new generate requests are refused (503, `role_switching`) while the accepted ones finish (a
decode first hands back those that sent their client nothing yet, with the same 503);
once every worker holds nothing (no request, room, lease or fenced block) each swaps its role on
the same engine, so its prefix cache stays. A switch that cannot start in time leaves the server
as it was; one that fails halfway leaves it FAILED: /health answers 503 rather than serve
half-switched.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from disagg.config import DisaggregationMode, LoadBalanceMethod
from disagg.dp.protocol import UtilityFailed
from disagg.http_edge import HttpError
from disagg.types import ErrorCode
from disagg.wire.engine_msgs import Utility
from disagg.worker.roles import RoleSpec

log = structlog.get_logger(__name__)
HOLDING_POLL_S = 0.05


class SwitchState(enum.Enum):
    SERVING = "serving"
    SWITCHING = "switching"  # new generate requests get 503 role_switching
    FAILED = "failed"  # some workers switched, some did not: unhealthy until restarted


class RoleSwitchError(HttpError):
    """A switch refused (409: another one runs, or one failed), cut short before any worker moved (503:
    the server goes on in its role) or failed halfway (500: the server is unhealthy)."""

    def __init__(self, message: str, status: int):
        super().__init__(status, message, param="new_role")


@dataclass
class PdRoles:
    """The server's role now and the roles it may take (both P/D modes)."""

    mode: DisaggregationMode
    specs: dict[DisaggregationMode, RoleSpec]
    methods: dict[DisaggregationMode, LoadBalanceMethod]
    epoch: int = 0
    state: SwitchState = SwitchState.SERVING
    failure: str | None = None
    target: DisaggregationMode | None = None  # while SWITCHING
    bootstrap_port: int | None = None  # the server's registry (it runs in both roles), for a router
    forget_ranks: Callable[[], None] | None = None  # empties that registry when the server leaves the prefill role

    @property
    def spec(self) -> RoleSpec:
        return self.specs[self.mode]

    def worker_roles(self) -> dict[str, RoleSpec]:
        """What a worker may switch to, by mode name (WorkerSpec.switch_roles)."""
        return {mode.value: spec for mode, spec in self.specs.items()}

    def refusal(self) -> str | None:
        """Why a new generate request is refused now, or None."""
        if self.state is SwitchState.SWITCHING:
            return f"this server is switching its role to {self.target}: send the request to another server"
        if self.state is SwitchState.FAILED:
            return f"this server's role switch failed ({self.failure}): it serves nothing until restarted"
        return None

    def info(self) -> dict:
        """What /server_info adds: the role epoch, the switch state (and why it failed)."""
        out = {"pd_role_epoch": self.epoch, "pd_role_switch_state": self.state.value,
               "disaggregation_bootstrap_port": self.bootstrap_port}
        return out if self.failure is None else {**out, "pd_role_switch_error": self.failure}

    def stale_epoch_error(self, routed_epoch: str | None) -> HttpError | None:
        """The 503 for a request a router sent for another role epoch (`X-PD-Role-Epoch`), else None."""
        if routed_epoch is None or routed_epoch.strip() == str(self.epoch):
            return None
        return HttpError(503, f"this server is a {self.mode.value} at role epoch {self.epoch}; the request was "
                              f"routed for role epoch {routed_epoch.strip()}: send it to another server",
                         code=ErrorCode.STALE_ROLE_EPOCH)

    def refusal_error(self) -> HttpError | None:
        """The 503 a new generate request gets while switching or after a failed switch."""
        message = self.refusal()
        return None if message is None else HttpError(503, message, code=ErrorCode.ROLE_SWITCHING)


async def switch_role(roles: PdRoles, new_mode: DisaggregationMode, *, timeout_s: float,
                      in_flight: Callable[[], int], call: Callable[..., Awaitable[list]],
                      hand_back: Callable[[HttpError], Awaitable[int]] | None = None) -> bool:
    """Switch the server to `new_mode`; False when it already runs it. `in_flight` counts the requests
    the front still serves; `call(method, *args, timeout_s=)` runs a utility on every worker. Leaving the
    decode role, `hand_back(error)` first ends the requests that sent their client nothing yet with the
    switch's 503 (a router sends them to another server): the switch then waits only for those that
    stream, not for a queue behind them.
    RoleSwitchError (409) when another switch runs or the server failed one, (503) when the accepted
    work did not end within `timeout_s` (the server goes on as it was)."""
    if roles.state is not SwitchState.SERVING:
        raise RoleSwitchError(roles.refusal() or "", 409)
    if new_mode is roles.mode:
        return False
    roles.state, roles.target = SwitchState.SWITCHING, new_mode
    log.info("role switch started", mode=roles.mode.value, new_mode=new_mode.value, epoch=roles.epoch)
    deadline = time.monotonic() + timeout_s
    try:
        if hand_back is not None and roles.mode is DisaggregationMode.DECODE:
            await hand_back(roles.refusal_error())
        await _until_nothing_held(in_flight, call, deadline, timeout_s)
    except BaseException:
        roles.state, roles.target = SwitchState.SERVING, None
        raise
    try:
        await call(Utility.SWITCH_ROLE, new_mode.value, timeout_s=max(deadline - time.monotonic(), 10.0))
    except (UtilityFailed, asyncio.TimeoutError) as exc:
        roles.state, roles.failure = SwitchState.FAILED, f"{type(exc).__name__}: {exc}"
        log.error("role switch failed: the server is unhealthy", error=roles.failure)
        raise RoleSwitchError(f"the role switch failed halfway ({roles.failure}): /health answers 503", 500) from None
    if roles.mode is DisaggregationMode.PREFILL and roles.forget_ranks is not None:
        roles.forget_ranks()  # its ranks stopped serving rooms: a decode must not connect to them
    roles.mode, roles.epoch, roles.state, roles.target = new_mode, roles.epoch + 1, SwitchState.SERVING, None
    log.info("role switched", mode=new_mode.value, epoch=roles.epoch)
    return True


async def _until_nothing_held(in_flight: Callable[[], int], call: Callable[..., Awaitable[list]],
                              deadline: float, timeout_s: float) -> None:
    """Wait until the front serves no request and no worker holds anything (bounded by `deadline`)."""
    held: list = []
    while time.monotonic() < deadline:
        if in_flight() == 0:
            held = [h for h in await call(Utility.HOLDING, timeout_s=max(deadline - time.monotonic(), 0.1))
                    if h is not None]
            if not held:
                return
        await asyncio.sleep(HOLDING_POLL_S)
    what = f"{in_flight()} requests in flight" if in_flight() else "; ".join(held) or "work"
    raise RoleSwitchError(f"the role switch did not start within {timeout_s:g} s ({what}): the server "
                          "goes on in its role", 503)
