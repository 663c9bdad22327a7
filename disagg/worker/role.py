"""What the worker loop (disagg/worker/process.py) asks of a role: the unified, prefill and decode roles.

`Role` is every role's contract; `RoomRole` adds what only the prefill role answers: the front's word
on where a bootstrap room went or that it will not be served. Plain Protocols: the loop checks a
room message against `RoomRole` before it calls one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from disagg.wire.engine_msgs import DecodeKey, GenerateMsg, OutputMsg, ReadyMsg, StatsMsg, Utility

if TYPE_CHECKING:
    from disagg.engine.core import EngineCore


@runtime_checkable
class Role(Protocol):
    """One engine behind the front's messages. Every method runs on the worker's event loop but
    `step()` and `utility()`, which run on its engine thread (torch work)."""

    core: EngineCore
    fault_injection: bool  # the server's --enable-fault-injection, set before start()
    step_delay_s: float  # a slow_steps fault: the loop sleeps this long before each engine step
    wake: Callable[[], None]  # set by the loop: ends its idle wait early

    async def start(self) -> None:
        """Set up what the role needs beyond the engine (the P/D roles: transfer agents, servers)."""

    async def close(self) -> None:
        """Release what start() set up."""

    def ready_msg(self) -> ReadyMsg:
        """The worker's first message to the front: the model and the KV cache it serves."""

    def note(self, msg: GenerateMsg) -> None:
        """Remember what a request's answers must carry, before submit() runs it."""

    async def submit(self, msg: GenerateMsg) -> list[OutputMsg]:
        """Admit a request; a refused one answers at once with its error."""

    async def abort(self, request_id: str) -> list[OutputMsg]:
        """End a request wherever it is; its blocks are freed (or fenced, P/D) by the role."""

    async def poll(self) -> list[OutputMsg]:
        """Advance background work between engine steps (the P/D roles: KV transfers)."""

    def idle_wait_s(self, default_s: float) -> float:
        """How long the loop may wait for messages when the engine is idle."""

    def has_work(self) -> bool:
        """Whether an engine step would do something."""

    def step(self) -> list[OutputMsg]:
        """One engine step's answers."""

    def fail_all(self, exc: Exception) -> list[OutputMsg]:
        """A step crashed outside any one request: end every request with the error."""

    def sent(self, msgs: list) -> None:
        """Messages on their way to the front: forget what note() kept for requests that ended."""

    def holding(self) -> str | None:
        """What the role still holds (requests, rooms, leases, fenced blocks), in words; None when it
        holds nothing and may give way to another role (a role switch)."""

    def utility(self, method: Utility, args: list) -> object:
        """Run one utility call (sleep, stats, tokenize, a fault...)."""

    def stats(self) -> StatsMsg:
        """The worker's load and cache figures, sent to the front twice a second."""


@runtime_checkable
class RoomRole(Role, Protocol):
    """A role that holds bootstrap rooms the front plans (the prefill role, push flow)."""

    def room_placed(self, room: int, dp_rank: int) -> list[OutputMsg]:
        """The front dispatched `room` to another rank (answer a decode that came here for it)."""

    async def room_failed(self, room: int, reason: str, decode: DecodeKey | None = None) -> list[OutputMsg]:
        """The front says `room` will not be served; `decode`: the misrouted decode that caused it, if one did."""
