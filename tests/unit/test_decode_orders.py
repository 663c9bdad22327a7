"""The decode role's per-request state machine (decode/requests.py) under random orders of events.

A real tiny engine and a real DecodeRole; only the flow is scripted: its fetch waits for the verdict
the test gives (SUCCESS with a first token, FAILED, the prefill lost, a timeout), and its `end()`
releases the blocks at once or fences them until the test ends the fence. Each order interleaves,
at random (seeded): requests arriving (some too big for the free cache, so they queue; some sent
alone, prefilled here or refused), verdicts, aborts (of held, queued and unknown requests), fences
ending, engine failures, polls and engine steps. Then everything still open is settled, and every request must have had exactly one final
answer, the role must hold nothing, and every block of the cache must be free again.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from decode.push import PushFetch
from decode.requests import DecodeRequest, DecodeRequests, DecodeState, IllegalMove
from decode.role import DecodeRole
from decode.waiting import PendingKV
from disagg.pd_config import DecodeConfig, DisaggConfig
from disagg.types import SamplingParams
from disagg.wire.control_msgs import TransferState, TransferStatusMsg
from disagg.wire.engine_msgs import GenerateMsg
from kvtransfer.base import PeerUnavailable

import random_orders
from test_engine_tiny import engine

ORDERS = 200  # random orders tried per run (each seed is one order)
EVENTS = 80  # events per order


class ScriptedFlow(PushFetch):
    """The push flow's admission, with the fetch's verdict and the fence's end given by the test."""

    def __init__(self, role: DecodeRole, rng: random.Random):
        super().__init__(role.core, 0, role.config, role.backend, None, role.fences)
        self.rng = rng
        self.verdicts: dict[str, asyncio.Future] = {}
        self.fenced: list[str] = []  # request ids whose blocks wait for the test to end their fence

    def check(self, msg: GenerateMsg) -> None:
        pass

    async def fetch(self, pending: PendingKV, reservation, deadline: float) -> TransferStatusMsg:
        request_id = pending.msg.request_id
        pending.client = "scripted"  # reached the prefill: from here an end may have to fence
        verdict = self.verdicts.setdefault(request_id, asyncio.get_running_loop().create_future())
        try:
            return await verdict
        except asyncio.CancelledError:  # the role ended it (a cancelled task may still start: it stops here)
            self.verdicts.pop(request_id, None)
            raise

    def open_verdicts(self) -> list[str]:
        """The fetches still waiting (a cancelled one's future is done before its task sees it)."""
        return sorted(request_id for request_id, future in self.verdicts.items() if not future.done())

    def end(self, request_id: str, pending: PendingKV, reason: str) -> bool:
        """As the real flows: nothing to fence before the fetch reached out; else at random."""
        self.verdicts.pop(request_id, None)
        if pending.client is None or self.rng.random() < 0.5:
            return True
        self.fenced.append(request_id)
        return False


def verdict(rng: random.Random, room: int) -> TransferStatusMsg | Exception:
    kind = rng.choice(["success", "success", "failed", "lost", "timeout"])
    if kind == "success":
        return TransferStatusMsg(room=room, state=TransferState.SUCCESS, first_token_id=rng.randrange(1, 200), num_bytes=64)
    if kind == "lost":
        return PeerUnavailable("lost connection to prefill p0")
    reason = "no KV from prefill within 0.5 s" if kind == "timeout" else "the prefill failed the room"
    return TransferStatusMsg(room=room, state=TransferState.FAILED, reason=reason)


class Order:
    """One random order of events against one role; `answers` counts each request's final answers."""

    def __init__(self, tiny_loaded, seed: int):
        self.rng = random.Random(seed)
        self.core = engine(tiny_loaded, num_blocks=24)
        config = DisaggConfig(transfer_backend="tcp", decode=DecodeConfig(max_local_prefill_tokens=12))  # some are prefilled here
        self.role = DecodeRole(self.core, 0, "tiny", config=config)
        self.role.backend = type("NoBackend", (), {"notifications": staticmethod(lambda: [])})()
        self.role.push = self.flow = ScriptedFlow(self.role, self.rng)
        self.submitted: list[str] = []
        self.answers: dict[str, int] = {}
        self.endings: Counter = Counter()  # how requests ended: (finish reason, error status)

    def took(self, msgs) -> None:
        self.role.sent(msgs)  # as the worker loop does with every message it sends
        for msg in msgs:
            if msg.finish_reason is not None or msg.error is not None:
                self.answers[msg.request_id] = self.answers.get(msg.request_id, 0) + 1
                self.endings[(str(msg.finish_reason), msg.error_status)] += 1

    async def event(self) -> None:
        rng, role = self.rng, self.role
        held = [r.request_id for r in role.requests]
        kind = rng.choice(["arrive", "arrive", "verdict", "verdict", "abort", "fence", "fail", "poll", "step", "step"])
        if kind == "arrive":
            request_id = f"r{len(self.submitted)}"
            self.submitted.append(request_id)
            prompt = [rng.randrange(1, 200) for _ in range(rng.choice([3, 9, 17, 40]))]
            alone = rng.random() < 0.25  # sent to the decode alone: prefilled here, or refused (400)
            p2p = {} if alone else dict(bootstrap_room=len(self.submitted), bootstrap_host="h", bootstrap_port=1)
            msg = GenerateMsg(request_id, SamplingParams(max_tokens=rng.randrange(1, 5), temperature=0, ignore_eos=True),
                              prompt_token_ids=prompt, **p2p)
            self.took(await role.submit(msg))
        elif kind == "verdict" and self.flow.open_verdicts():
            request_id = rng.choice(self.flow.open_verdicts())
            future = self.flow.verdicts.pop(request_id)
            result = verdict(rng, 0)
            future.set_exception(result) if isinstance(result, Exception) else future.set_result(result)
        elif kind == "abort":
            request_id = rng.choice(held + ["unknown", rng.choice(self.submitted or ["unknown"])])
            self.took(await role.abort(request_id))
        elif kind == "fence" and self.flow.fenced:
            role.fences.fenced(self.flow.fenced.pop(rng.randrange(len(self.flow.fenced))))
        elif kind == "fail":
            fetching = role.requests.in_state(DecodeState.FETCHING, DecodeState.LANDED)
            if fetching:
                self.core.fail(rng.choice(fetching).request_id, "the engine could not run it")
        elif kind == "step" and role.has_work():
            self.took(role.step())
        self.took(await role.poll())
        await asyncio.sleep(0)  # the fetch tasks see their verdicts

    async def settle(self) -> None:
        """Every verdict given (SUCCESS), every fence ended, every request run to its end."""
        for _ in range(1000):
            if not (len(self.role.requests) or self.role.has_work() or self.flow.fenced):
                return
            for request_id in self.flow.open_verdicts():
                self.flow.verdicts.pop(request_id).set_result(TransferStatusMsg(room=0, state=TransferState.SUCCESS, first_token_id=7, num_bytes=64))
            while self.flow.fenced:
                self.role.fences.fenced(self.flow.fenced.pop())
            await asyncio.sleep(0)
            self.took(await self.role.poll())
            if self.role.has_work():
                self.took(self.role.step())
        raise AssertionError(f"not settled: {[(r.request_id, r.state) for r in self.role.requests]}")

    def check(self) -> None:
        assert len(self.role.requests) == 0
        assert not self.core.has_unfinished()
        assert {rid: self.answers.get(rid, 0) for rid in self.submitted} == {rid: 1 for rid in self.submitted}
        self.core.kv.pool.check_integrity()
        assert self.core.kv.num_free_blocks == self.core.num_blocks
        assert self.core.stats().num_quarantined_blocks == 0


async def run_order(tiny_loaded, seed: int) -> Order:
    return await random_orders.run(Order(tiny_loaded, seed), EVENTS)


def test_every_request_ends_once_with_its_blocks_freed_in_any_order(tiny_loaded):
    endings: Counter = Counter()
    for seed in range(ORDERS):
        endings += asyncio.run(run_order(tiny_loaded, seed)).endings
    # Every way to end was taken, many times: served (by a prefill's KV or prefilled here), aborted,
    # refused a local prefill, failed by the engine, the prefill's failure, the prefill lost.
    assert {kind for kind, count in endings.items() if count >= 20} == {
        ("length", 0), ("abort", 0), ("abort", 400), ("abort", 500), ("abort", 503)}


def test_the_orders_catch_one_skipped_free(tiny_loaded):
    """The mutation: one request's quarantined blocks are not given back. Every order in which the
    role gave back any catches it (the others never quarantined a request)."""
    caught, released = random_orders.count_caught(lambda seed: Order(tiny_loaded, seed), ORDERS, EVENTS)
    assert caught == released > ORDERS * 3 // 4


def test_the_table_refuses_moves_it_does_not_have():
    requests = DecodeRequests()
    requests.add(DecodeRequest("a", DecodeState.QUEUED))
    with pytest.raises(IllegalMove, match="^request a: QUEUED -> LANDED$"):
        requests.move("a", DecodeState.LANDED)
    requests.move("a", DecodeState.FETCHING)
    requests.move("a", DecodeState.FENCED)
    with pytest.raises(IllegalMove, match="^request a: FENCED dropped without its fence$"):
        requests.drop("a")
    assert requests.drop("a", fenced=True).state is DecodeState.FENCED and len(requests) == 0
    requests.add(DecodeRequest("b", DecodeState.LOCAL))
    with pytest.raises(IllegalMove, match="^request b: LOCAL dropped by its fence$"):
        requests.drop("b", fenced=True)
    with pytest.raises(AssertionError, match="^request b held twice"):
        requests.add(DecodeRequest("b", DecodeState.QUEUED))
