"""disagg.drain on its own: in-flight tracking, the wait, the abort, claiming the cancellation, signals."""

import asyncio
import os
import signal
import time

import pytest

from disagg.drain import Drain, StopSignals

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(10)]


async def handler(drain: Drain, hold: asyncio.Event, outcomes: list[str]) -> None:
    """A request handler as the servers write them: claims the drain's abort and answers."""
    with drain.track():
        try:
            await hold.wait()
            outcomes.append("finished")
        except asyncio.CancelledError:
            if not drain.claim_abort():
                raise
            outcomes.append(drain.abort_message())


async def started(*tasks: asyncio.Task) -> None:
    await asyncio.sleep(0)  # each task enters track()
    assert all(not t.done() for t in tasks)


async def test_requests_that_finish_in_time_are_not_aborted():
    drain, hold, outcomes = Drain(), asyncio.Event(), []
    tasks = [asyncio.create_task(handler(drain, hold, outcomes)) for _ in range(2)]
    await started(*tasks)
    assert (drain.draining, drain.num_in_flight) == (False, 2)
    run = asyncio.create_task(drain.run(5.0))
    await asyncio.sleep(0.05)
    assert (drain.draining, run.done(), drain.refusal_message()) == (True, False, "server is draining: it accepts no new requests")
    hold.set()
    assert await run == 0
    assert (outcomes, drain.num_in_flight, drain.abort_reason) == (["finished", "finished"], 0, None)


async def test_requests_left_at_the_timeout_are_cancelled_and_told_why():
    drain, outcomes = Drain("router"), []
    task = asyncio.create_task(handler(drain, asyncio.Event(), outcomes))
    await started(task)
    start = time.monotonic()
    assert await drain.run(0.2) == 1
    assert 0.2 <= time.monotonic() - start < 1.0
    await task
    assert outcomes == ["router shut down before the request finished (shutdown timeout 0.2 s)"]
    assert (task.cancelling(), drain.num_in_flight) == (0, 0)  # the cancellation was taken back


async def test_a_second_signal_ends_the_wait_at_once():
    drain, hurry, outcomes = Drain(), asyncio.Event(), []
    task = asyncio.create_task(handler(drain, asyncio.Event(), outcomes))
    await started(task)
    asyncio.get_running_loop().call_later(0.1, hurry.set)
    start = time.monotonic()
    assert await drain.run(30.0, hurry) == 1
    assert time.monotonic() - start < 1.0
    await task
    assert outcomes == ["server shut down before the request finished (a second stop signal ended the drain)"]


async def test_an_idle_server_drains_at_once_and_zero_timeout_aborts_at_once():
    assert await Drain().run(0.0) == 0
    drain, outcomes = Drain(), []
    task = asyncio.create_task(handler(drain, asyncio.Event(), outcomes))
    await started(task)
    assert await drain.run(0.0) == 1
    await task
    assert outcomes == ["server shut down before the request finished (shutdown timeout 0 s)"]


async def test_a_cancellation_the_drain_did_not_cause_is_not_claimed():
    drain, outcomes = Drain(), []
    task = asyncio.create_task(handler(drain, asyncio.Event(), outcomes))
    await started(task)
    task.cancel()  # e.g. the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (outcomes, drain.num_in_flight) == ([], 0)


async def test_stop_signals_first_requests_then_hurries():
    signals = StopSignals()
    signals.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(signals.requested.wait(), 2)
        assert not signals.hurry.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(signals.hurry.wait(), 2)
    finally:
        loop = asyncio.get_running_loop()
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)
