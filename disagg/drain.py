"""Graceful drain of one HTTP server (a front door or the router), and the stop signals that start it.

SIGTERM or SIGINT starts the drain: the server refuses new requests and its health goes red, the
requests in flight get `timeout_s` to finish, then the drain aborts what is left by cancelling those
handlers; each aborted handler claims its cancellation (`claim_abort`) and answers its client with
`abort_message()`. A second signal cuts the wait short. asyncio only: the front door, the router and
the launchers share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

ABORT_ANSWER_S = 5.0  # how long aborted handlers get to answer their clients before the server closes
CLOSE_TIMEOUT_S = 5.0  # how long handlers still running when a server closes get (aiohttp's shutdown_timeout)


class Drain:
    """The drain state of one server; `who` ("server", "router") names it in client messages."""

    def __init__(self, who: str = "server"):
        self.who = who
        self.draining = False
        self.abort_reason: str | None = None
        self._tasks: set[asyncio.Task] = set()
        self._aborted: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        """Requests inside `track()` now."""
        return len(self._tasks)

    def refusal_message(self) -> str:
        """What a new request (and `/health`) is told while the server drains."""
        return f"{self.who} is draining: it accepts no new requests"

    def abort_message(self) -> str:
        """What a request aborted by the drain is told."""
        return f"{self.who} shut down before the request finished ({self.abort_reason})"

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count the current task's request as in flight until the block ends."""
        task = asyncio.current_task()
        assert task is not None, "track() runs inside a task"
        self._tasks.add(task)
        self._idle.clear()
        try:
            yield
        finally:
            self._tasks.discard(task)
            self._aborted.discard(task)
            if not self._tasks:
                self._idle.set()

    def claim_abort(self) -> bool:
        """Called where a handler caught CancelledError: True when the drain cancelled it (the
        cancellation is then taken back, so the handler can answer its client); False otherwise,
        and the handler re-raises."""
        task = asyncio.current_task()
        if task not in self._aborted:
            return False
        self._aborted.discard(task)
        task.uncancel()
        return True

    async def run(self, timeout_s: float, hurry: asyncio.Event | None = None) -> int:
        """Drain: refuse new requests from now on, wait up to `timeout_s` (less if `hurry` is set) for
        the requests in flight, then abort the rest and give their handlers `ABORT_ANSWER_S` to answer.
        Returns how many requests were aborted."""
        self.draining = True
        if await self._wait_idle(timeout_s, hurry):
            return 0
        stopped_early = hurry is not None and hurry.is_set()
        self.abort_reason = "a second stop signal ended the drain" if stopped_early else f"shutdown timeout {timeout_s:g} s"
        aborted = list(self._tasks)
        self._aborted.update(aborted)
        for task in aborted:
            task.cancel()
        await self._wait_idle(ABORT_ANSWER_S)
        return len(aborted)

    async def _wait_idle(self, timeout_s: float, hurry: asyncio.Event | None = None) -> bool:
        """True once nothing is in flight; False when `timeout_s` passed or `hurry` was set first."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self._idle.is_set()


class StopSignals:
    """SIGINT and SIGTERM on the running loop: the first sets `requested`, any later one `hurry`."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.hurry = asyncio.Event()

    def install(self) -> None:
        """Handle both signals on the running loop from now on."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal)

    def _on_signal(self) -> None:
        (self.hurry if self.requested.is_set() else self.requested).set()
