"""The prefill push flow's rooms (prefill/rooms.py's RoomBook) under random orders of events.

A real tiny engine and real PushRooms; the transfer backend and the control server are scripted: a
write's handle ends when the test says (landed or failed), and every status sent to a decode is
recorded. Each order interleaves, at random (seeded): requests arriving (new rooms and rooms heard
of before), decodes' destinations (before or after their request), engine steps, writes ending,
aborts by the client and by the decode, the front's word (a room failed, a room placed on another
rank), a decode lost, and time passing beyond the deadlines. Then everything is settled and every
verdict expires: every request must have had exactly one final answer, every decode that sent a
destination a final status, and the book, the engine's blocks and the backend's handles must be
empty again.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from disagg.pd_config import DisaggConfig, PrefillConfig
from disagg.types import SamplingParams
from disagg.wire.control_msgs import TransferInfoMsg, TransferState
from disagg.wire.engine_msgs import GenerateMsg, RoomMisroutedMsg
from disagg.worker.outputs import to_output_msg
from prefill.push import PushRooms
from prefill.rooms import IllegalMove, PrefillRoom, RoomBook, RoomState

import random_orders
from test_engine_tiny import engine

ORDERS = 150
EVENTS = 80
TTL_S = 30.0  # bootstrap_timeout_s: how long verdicts live and a room waits for its destination


@dataclass
class Handle:
    num_bytes: int
    state: TransferState = TransferState.TRANSFERRING
    reason: str = ""


class ScriptedBackend:
    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self.released: set[int] = set()

    def write(self, peer, src, dst, tag) -> Handle:
        assert len(src) == len(dst) > 0
        self.handles.append(Handle(64 * len(src)))
        return self.handles[-1]

    def poll(self, handle: Handle) -> Handle:
        return handle

    def release(self, handle: Handle) -> None:
        assert id(handle) not in self.released, "a handle released twice"
        self.released.add(id(handle))

    def remove_peer(self, peer) -> None:
        pass


class ScriptedControl:
    def __init__(self) -> None:
        self.statuses: list = []
        self.dropped: list[str] = []

    def is_writable(self, room: int) -> bool:
        return True

    def send_status(self, msg) -> None:
        self.statuses.append(msg)

    def drop_peer(self, peer_name: str, reason: str) -> None:
        self.dropped.append(peer_name)


async def no_registry(room: int, dp_rank: int) -> None:
    pass


class Order:
    def __init__(self, tiny_loaded, seed: int):
        self.rng = random.Random(seed)
        self.core = engine(tiny_loaded, num_blocks=64)
        self.backend, self.control = ScriptedBackend(), ScriptedControl()
        config = DisaggConfig(transfer_backend="tcp", prefill=PrefillConfig(bootstrap_timeout_s=TTL_S, transfer_timeout_s=TTL_S))
        self.push = PushRooms(self.core, 0, config, self.backend, self.control, no_registry)
        self.push.peers = {"d0": "peer-d0", "d1": "peer-d1"}
        self.now = time.monotonic()
        self.submitted: list[str] = []
        # room -> the decode whose destination it holds (a later one replaces it, as a stray duplicate
        # would), while that decode lives: it must hear how the room ended.
        self.told: dict[int, str] = {}
        self.answers: Counter = Counter()
        self.endings: Counter = Counter()
        self.started: set[str] = set()
        self.misrouted: list[RoomMisroutedMsg] = []
        # A room's prompt length, known to its decode too (its destination has that many blocks).
        self.prompt_len = {room: self.rng.choice([5, 12, 30]) for room in range(1, 12)}

    def took(self, msgs) -> None:
        for msg in msgs:
            if isinstance(msg, RoomMisroutedMsg):  # to the front, which tells every worker: this one too
                self.misrouted.append(msg)
            elif msg.finish_reason is not None or msg.error is not None:
                self.answers[msg.request_id] += 1
                self.endings[(str(msg.finish_reason), msg.error_status)] += 1

    def room(self) -> int:
        return self.rng.randrange(1, 12)  # few rooms: they meet again in every state

    def info(self, room: int) -> TransferInfoMsg:
        peer = self.rng.choice(["d0", "d1"])
        self.told[room] = peer
        num_blocks = -(-self.prompt_len[room] // self.core.block_size)
        return TransferInfoMsg(room=room, peer_name=peer,
                               dst_block_ids=tuple(range(100, 100 + num_blocks)), request_id=f"dec-{room}")

    def step(self) -> None:
        for out in self.core.step():
            msg = to_output_msg(out, out.request_id not in self.started)
            self.started.add(out.request_id)
            if not self.push.take(out, msg):
                self.took([msg])

    async def event(self) -> None:
        rng, push = self.rng, self.push
        kind = rng.choice(["arrive", "arrive", "info", "info", "step", "step", "land", "land", "abort",
                           "decode_abort", "failed", "placed", "lost", "late"])
        if kind == "arrive":
            request_id = f"p{len(self.submitted)}"
            self.submitted.append(request_id)
            room = self.room()
            prompt = [rng.randrange(1, 200) for _ in range(self.prompt_len[room])]
            msg = GenerateMsg(request_id, SamplingParams(max_tokens=1, temperature=0), prompt_token_ids=prompt,
                              bootstrap_room=room, bootstrap_host="h", bootstrap_port=1)
            self.took(await push.submit(msg, lambda m: list(m.prompt_token_ids), msg.sampling))
        elif kind == "info":
            self.took(push.on_transfer_info(self.info(self.room())))
        elif kind == "step" and self.core.has_unfinished():
            self.step()
        elif kind == "land":
            open_handles = [h for h in self.backend.handles if h.state is TransferState.TRANSFERRING]
            if open_handles:
                handle = rng.choice(open_handles)
                handle.state, handle.reason = rng.choice([(TransferState.SUCCESS, "")] * 3 + [(TransferState.FAILED, "reset")])
        elif kind == "abort" and self.submitted:
            self.took(push.abort(rng.choice(self.submitted)) or [])
        elif kind == "decode_abort":
            self.took(push.on_decode_abort(self.room(), "client gone"))
        elif kind == "failed":
            self.took(await push.room_failed(self.room(), "its decode went to another rank"))
        elif kind == "placed":
            self.took(push.room_placed(self.room(), 1))
        elif kind == "lost":
            peer = rng.choice(["d0", "d1"])
            rooms = [room for room, state in push.book.running.items() if state.info and state.info.peer_name == peer]
            self.took(push.on_peer_lost(peer, rooms, "stream closed"))  # the rooms its stream held
            self.told = {room: p for room, p in self.told.items() if p != peer}  # a lost decode hears nothing more
            push.peers[peer] = f"peer-{peer}"  # it registers again
        elif kind == "late":
            self.now += rng.choice([1.0, TTL_S + 1])
        self.took(push.advance(self.now))
        self.forget_dropped()
        while self.misrouted:
            msg = self.misrouted.pop()
            self.took(await push.room_failed(msg.bootstrap_room, msg.reason, msg.decode))

    def forget_dropped(self) -> None:
        """A decode whose writes did not settle in time has its stream dropped: like a lost one, it
        hears nothing more of its rooms (it cuts this prefill off itself)."""
        while self.control.dropped:
            peer = self.control.dropped.pop()
            self.told = {room: p for room, p in self.told.items() if p != peer}

    async def settle(self) -> None:
        for _ in range(2000):
            if not (self.push.book.running or self.core.has_unfinished() or self.push.settling):
                break
            for handle in self.backend.handles:
                if handle.state is TransferState.TRANSFERRING:
                    handle.state = TransferState.SUCCESS
            for room, state in list(self.push.book.running.items()):
                if state.info is None:
                    self.took(self.push.on_transfer_info(self.info(room)))
            if self.core.has_unfinished():
                self.step()
            self.took(self.push.advance(self.now))
            self.forget_dropped()
        else:
            raise AssertionError(f"not settled: {self.push.book.running}")
        self.now += TTL_S + 1  # every verdict expires
        self.took(self.push.advance(self.now))

    def check(self) -> None:
        assert len(self.push.book) == 0 and self.push.book.num_early == 0 and self.push.settling == []
        assert {rid: self.answers[rid] for rid in self.submitted} == {rid: 1 for rid in self.submitted}
        finals = {s.room for s in self.control.statuses if s.state in (TransferState.SUCCESS, TransferState.FAILED)}
        assert set(self.told) <= finals  # every live decode that sent a destination heard how it ended
        assert not self.core.has_unfinished()
        self.core.kv.pool.check_integrity()
        assert self.core.kv.num_free_blocks == self.core.num_blocks
        assert self.backend.released == {id(h) for h in self.backend.handles}


async def run_order(tiny_loaded, seed: int) -> Order:
    return await random_orders.run(Order(tiny_loaded, seed), EVENTS)


def test_every_room_ends_once_with_its_blocks_and_handles_freed_in_any_order(tiny_loaded):
    endings: Counter = Counter()
    for seed in range(ORDERS):
        endings += asyncio.run(run_order(tiny_loaded, seed)).endings
    # Every way to end was taken, many times: served, rejected (a room in use), failed (a write, the
    # front's word, a lost decode), aborted by the client or the decode, a destination too late.
    assert {kind for kind, count in endings.items() if count >= 20} == {
        ("length", 0), ("abort", 400), ("abort", 500), ("abort", 499), ("abort", 504)}


def test_the_orders_catch_one_skipped_free(tiny_loaded):
    """The mutation: one served room's held blocks are not given back. Every order that served a
    room (many end every room some other way first) catches it."""
    caught, released = random_orders.count_caught(lambda seed: Order(tiny_loaded, seed), ORDERS, EVENTS)
    assert caught == released >= ORDERS // 10


def test_the_book_refuses_moves_it_does_not_have():
    book = RoomBook(TTL_S)
    with pytest.raises(IllegalMove, match="^bootstrap_room 7: NEW -> SERVED$"):
        book.settle(7, RoomState.SERVED, "r1")
    book.settle(7, RoomState.FAILED, "its decode went elsewhere")
    with pytest.raises(IllegalMove, match="^bootstrap_room 7: FAILED -> EARLY$"):
        book.settle(7, RoomState.EARLY, None)
    book.start(PrefillRoom(7, "r2", 0.0, 4))
    with pytest.raises(IllegalMove, match="^bootstrap_room 7: WAITING -> SERVED$"):
        book.settle(7, RoomState.SERVED, "r2")
    with pytest.raises(IllegalMove, match="^bootstrap_room 7: WAITING -> NEW$"):
        book.forget(7)
    assert book.attach(7).state is RoomState.SENDING and book.by_request == {"r2": 7}
    book.settle(7, RoomState.FAILED, "why")
    assert (book.state_of(7), book.verdict(7), book.by_request, book.running) == (RoomState.FAILED, "why", {}, {})
    assert book.expired(time.monotonic() + TTL_S + 1) == [(7, RoomState.FAILED, "why")] and len(book) == 0
