"""The front's side of a role switch (disagg/dp/role_switch.py) against scripted workers: it waits for
the requests in flight and for every worker to hold nothing, then switches every worker at once;
a switch that cannot start in time leaves the server as it was; one that fails halfway leaves it
failed (503 to new requests, /health red)."""

import asyncio

import pytest

from disagg.config import DisaggregationMode, LoadBalanceMethod
from disagg.dp.protocol import UtilityFailed
from disagg.dp.role_switch import PdRoles, RoleSwitchError, SwitchState, switch_role
from disagg.wire.engine_msgs import Utility
from disagg.worker.roles import RoleSpec, decode_role, prefill_role

PREFILL, DECODE = DisaggregationMode.PREFILL, DisaggregationMode.DECODE


def roles() -> PdRoles:
    return PdRoles(PREFILL, {PREFILL: RoleSpec(prefill_role), DECODE: RoleSpec(decode_role)},
                   {PREFILL: LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM, DECODE: LoadBalanceMethod.LEAST_LOAD})


class Workers:
    """Two scripted workers: each HOLDING call answers the next of `holding`; SWITCH_ROLE fails when told."""

    def __init__(self, holding: list[list], fail_switch: bool = False):
        self.holding, self.fail_switch, self.calls = list(holding), fail_switch, []

    async def call(self, method: Utility, *args, timeout_s: float) -> list:
        self.calls.append((method, *args))
        if method is Utility.HOLDING:
            return self.holding.pop(0) if self.holding else [None, None]
        if self.fail_switch:
            raise UtilityFailed(method.value, {1: "RuntimeError: the control server did not start"})
        return [None, None]


@pytest.mark.asyncio
async def test_it_waits_for_the_requests_in_flight_and_what_the_workers_hold():
    r, in_flight = roles(), [2, 1, 0, 0, 0]
    workers = Workers([["1 bootstrap rooms", None], [None, "2 KV leases"], [None, None]])
    assert await switch_role(r, DECODE, timeout_s=5, in_flight=lambda: in_flight.pop(0) if len(in_flight) > 1 else 0,
                             call=workers.call) is True
    assert workers.calls == [(Utility.HOLDING,)] * 3 + [(Utility.SWITCH_ROLE, "decode")]
    assert (r.mode, r.epoch, r.state, r.spec.factory) == (DECODE, 1, SwitchState.SERVING, decode_role)
    assert r.info() == {"pd_role_epoch": 1, "pd_role_switch_state": "serving", "disaggregation_bootstrap_port": None}
    assert r.refusal_error() is None and r.stale_epoch_error("1") is None and r.stale_epoch_error(None) is None
    stale = r.stale_epoch_error("0")
    assert (stale.status, stale.code, stale.message) == (503, "stale_role_epoch", (
        "this server is a decode at role epoch 1; the request was routed for role epoch 0: send it to another server"))


@pytest.mark.asyncio
async def test_the_same_role_is_no_switch():
    r, workers = roles(), Workers([])
    assert await switch_role(r, PREFILL, timeout_s=5, in_flight=lambda: 0, call=workers.call) is False
    assert (workers.calls, r.epoch) == ([], 0)


@pytest.mark.asyncio
async def test_new_requests_are_refused_while_it_switches():
    r, workers = roles(), Workers([["1 requests in the engine", None]] * 4)
    switching = asyncio.create_task(switch_role(r, DECODE, timeout_s=5, in_flight=lambda: 0, call=workers.call))
    await asyncio.sleep(0.01)
    refused = r.refusal_error()
    assert (refused.status, refused.code, refused.message) == (
        503, "role_switching", "this server is switching its role to decode: send the request to another server")
    with pytest.raises(RoleSwitchError) as again:
        await switch_role(r, PREFILL, timeout_s=5, in_flight=lambda: 0, call=workers.call)
    assert again.value.status == 409
    assert await switching is True and r.state is SwitchState.SERVING


@pytest.mark.asyncio
async def test_work_that_does_not_end_in_time_leaves_the_server_as_it_was():
    r, workers = roles(), Workers([])
    with pytest.raises(RoleSwitchError) as refused:
        await switch_role(r, DECODE, timeout_s=0.2, in_flight=lambda: 3, call=workers.call)
    assert (refused.value.status, refused.value.message) == (
        503, "the role switch did not start within 0.2 s (3 requests in flight): the server goes on in its role")
    assert (r.mode, r.epoch, r.state, workers.calls) == (PREFILL, 0, SwitchState.SERVING, [])
    held = Workers([["4 quarantined KV blocks", None]] * 100)
    with pytest.raises(RoleSwitchError, match=r"within 0.2 s \(4 quarantined KV blocks\)"):
        await switch_role(r, DECODE, timeout_s=0.2, in_flight=lambda: 0, call=held.call)
    assert (Utility.SWITCH_ROLE, "decode") not in held.calls and r.state is SwitchState.SERVING


@pytest.mark.asyncio
async def test_a_switch_that_fails_halfway_leaves_the_server_failed():
    r, workers = roles(), Workers([], fail_switch=True)
    with pytest.raises(RoleSwitchError) as failed:
        await switch_role(r, DECODE, timeout_s=5, in_flight=lambda: 0, call=workers.call)
    reason = ("UtilityFailed: switch_role failed on 1 DP worker(s) (dp_rank 1: RuntimeError: the control server "
              "did not start)")
    assert (failed.value.status, failed.value.message) == (
        500, f"the role switch failed halfway ({reason}): /health answers 503")
    assert (r.mode, r.epoch, r.state, r.failure) == (PREFILL, 0, SwitchState.FAILED, reason)
    assert r.refusal_error().message == f"this server's role switch failed ({reason}): it serves nothing until restarted"
    assert r.info() == {"pd_role_epoch": 0, "pd_role_switch_state": "failed", "disaggregation_bootstrap_port": None,
                        "pd_role_switch_error": reason}
    with pytest.raises(RoleSwitchError) as again:
        await switch_role(r, DECODE, timeout_s=5, in_flight=lambda: 0, call=workers.call)
    assert again.value.status == 409


@pytest.mark.asyncio
async def test_leaving_the_decode_role_hands_back_what_sent_nothing_first():
    """`hand_back` gets the switch's own 503 once, before the wait, when the server leaves the decode role;
    a prefill's switch hands nothing back (its requests end with their one token soon)."""
    handed: list[tuple] = []

    async def hand_back(error) -> int:
        handed.append((error.status, error.code, error.message))
        return 2

    r = roles()
    assert await switch_role(r, DECODE, timeout_s=5, in_flight=lambda: 0, call=Workers([]).call,
                             hand_back=hand_back) is True
    assert handed == []
    assert await switch_role(r, PREFILL, timeout_s=5, in_flight=lambda: 0, call=Workers([]).call,
                             hand_back=hand_back) is True
    assert handed == [(503, "role_switching",
                       "this server is switching its role to prefill: send the request to another server")]
