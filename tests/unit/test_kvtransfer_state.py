"""Transfer states: the Enum's rules, TransferTable, and deadline waits with a fake clock."""

from __future__ import annotations

import pytest

from kvtransfer.base import (
    TransferFailed, TransferHandle, TransferOp, TransferState, TransferStatus, UnknownTransfer, backoff_delays, wait,
    wait_all,
)
from kvtransfer.transfers import TransferTable

S = TransferState


def test_states_only_move_forward_and_terminal_states_stick():
    assert S.BOOTSTRAPPING.can_become(S.WAITING_FOR_INPUT)
    assert S.WAITING_FOR_INPUT.can_become(S.FAILED)
    assert S.TRANSFERRING.can_become(S.SUCCESS)
    assert not S.TRANSFERRING.can_become(S.WAITING_FOR_INPUT)
    assert not S.TRANSFERRING.can_become(S.TRANSFERRING)
    assert not S.SUCCESS.can_become(S.FAILED)
    assert not S.FAILED.can_become(S.SUCCESS)
    assert [s for s in S if s.is_terminal] == [S.SUCCESS, S.FAILED]


def test_table_walks_the_life_of_a_room():
    table = TransferTable()
    table.open("room-7", S.BOOTSTRAPPING)
    assert table.advance("room-7", S.WAITING_FOR_INPUT)
    assert table.advance("room-7", S.TRANSFERRING)
    assert not table.advance("room-7", S.WAITING_FOR_INPUT)
    assert table.advance("room-7", S.SUCCESS)
    assert not table.fail("room-7", "late error")
    assert table.get("room-7") == TransferStatus(S.SUCCESS)


def test_failed_is_sticky_and_keeps_the_first_reason():
    table = TransferTable()
    table.open(1)
    assert table.fail(1, "peer died")
    assert not table.fail(1, "deadline exceeded after 1 s")
    assert not table.advance(1, S.SUCCESS)
    assert table.get(1) == TransferStatus(S.FAILED, "peer died")


def test_a_late_failed_never_recreates_a_cleared_transfer():
    table = TransferTable()
    table.open(1)
    assert table.clear(1) == TransferStatus(S.TRANSFERRING)
    assert not table.fail(1, "late")
    assert 1 not in table and len(table) == 0
    with pytest.raises(UnknownTransfer, match="transfer 1 is unknown or was released"):
        table.get(1)


def test_raise_if_failed_carries_the_reason():
    TransferStatus(S.SUCCESS).raise_if_failed()
    TransferStatus(S.TRANSFERRING).raise_if_failed()
    with pytest.raises(TransferFailed) as excinfo:
        TransferStatus(S.FAILED, "peer 'p' lost").raise_if_failed()
    assert excinfo.value.reason == "peer 'p' lost"


def test_fail_all_touches_only_live_transfers():
    table = TransferTable()
    for key in (1, 2, 3):
        table.open(key)
    table.advance(2, S.SUCCESS)
    assert table.fail_all("closing") == [1, 3]
    assert table.live_keys() == []
    assert table.get(2).ok


def test_backoff_starts_with_immediate_repolls_then_grows_to_a_cap():
    delays = backoff_delays(initial_s=1e-5, max_s=5e-5, growth=2.0)
    assert [next(delays) for _ in range(7)] == [0.0, 0.0, 1e-5, 2e-5, 4e-5, 5e-5, 5e-5]
    default = backoff_delays()
    assert [round(next(default) * 1e6, 2) for _ in range(5)] == [0.0, 0.0, 50.0, 62.5, 78.12]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class ScriptedBackend:
    """poll() answers TRANSFERRING until its transfer's turn comes; abort() records and fails it."""

    def __init__(self, done_after_polls: dict[int, int]) -> None:
        self.table = TransferTable()
        self.polls = dict.fromkeys(done_after_polls, 0)
        self.done_after = done_after_polls
        self.aborted: list[tuple[int, str]] = []
        for key in done_after_polls:
            self.table.open(key)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        self.polls[handle.transfer_id] += 1
        if self.polls[handle.transfer_id] >= self.done_after[handle.transfer_id]:
            self.table.advance(handle.transfer_id, S.SUCCESS)
        return self.table.get(handle.transfer_id)

    def abort(self, handle: TransferHandle, reason: str) -> None:
        self.aborted.append((handle.transfer_id, reason))
        self.table.fail(handle.transfer_id, reason)


def handle(transfer_id: int) -> TransferHandle:
    return TransferHandle(transfer_id, "peer", TransferOp.WRITE, 1, 4096)


def test_wait_returns_success_without_aborting():
    clock, backend = FakeClock(), ScriptedBackend({1: 4})
    assert wait(backend, handle(1), 1.0, clock=clock, sleep=clock.sleep) == TransferStatus(S.SUCCESS)
    assert backend.aborted == [] and backend.polls[1] == 4
    assert clock.sleeps == [0.0, 0.0, 50e-6]


def test_an_expired_deadline_aborts_with_the_exact_reason():
    clock, backend = FakeClock(), ScriptedBackend({1: 10**9})
    status = wait(backend, handle(1), 0.25, clock=clock, sleep=clock.sleep)
    assert status == TransferStatus(S.FAILED, "deadline exceeded after 0.25 s")
    assert backend.aborted == [(1, "deadline exceeded after 0.25 s")]
    assert clock.now == pytest.approx(100.25)
    assert max(clock.sleeps) <= 1e-3


def test_wait_all_shares_one_deadline_and_keeps_order():
    clock, backend = FakeClock(), ScriptedBackend({1: 10**9, 2: 2})
    statuses = wait_all(backend, [handle(1), handle(2)], 0.01, clock=clock, sleep=clock.sleep)
    assert statuses == [TransferStatus(S.FAILED, "deadline exceeded after 0.01 s"), TransferStatus(S.SUCCESS)]
    assert backend.polls[2] == 2
