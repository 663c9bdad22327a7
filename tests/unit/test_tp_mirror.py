"""MirroredCore hands the followers each call that changes the engine, before rank 0 makes it, and
nothing else; a follower makes the calls in that order, drops one that raised (it raised on rank 0
too) and ends on a step that raises."""

import pytest

from disagg.worker.tp_group import MirroredCore, follow
from disagg.wire.engine_msgs import ShutdownMsg


class Recorder:
    def __init__(self):
        self.calls = []
        self.outputs_taken = 0
        self.num_blocks = 96

    def add_request(self, request_id, prompt, params, hold_blocks=False):
        self.calls.append(("add_request", request_id, tuple(prompt), hold_blocks))
        if not prompt:
            raise ValueError("empty prompt")

    def admit_remote_kv(self, request_id, first_token_id):
        self.calls.append(("admit_remote_kv", request_id, first_token_id))
        return True

    def request_progress(self, request_id):
        self.calls.append(("request_progress", request_id))

    def step(self):
        self.calls.append(("step",))
        if len(self.calls) > 5:
            raise RuntimeError("collective timed out")
        return []

    def take_outputs(self):
        self.outputs_taken += 1
        return []


class Sent:
    def __init__(self):
        self.msgs = []

    def forward(self, msg):
        self.msgs.append(msg)


class Pipe:
    def __init__(self, msgs):
        self.msgs = list(msgs)

    def recv(self):
        if not self.msgs:
            raise EOFError
        return self.msgs.pop(0)


def test_only_state_changes_are_mirrored_and_before_rank_0_runs_them():
    core, followers = Recorder(), Sent()
    mirrored = MirroredCore(core, followers)
    mirrored.add_request("a", [1, 2], None, hold_blocks=True)
    assert mirrored.admit_remote_kv("a", first_token_id=7) is True
    mirrored.request_progress("a")
    assert mirrored.num_blocks == 96
    mirrored.step()
    with pytest.raises(ValueError, match="empty prompt"):
        mirrored.add_request("b", [], None)
    assert followers.msgs == [
        ("add_request", ("a", [1, 2], None), {"hold_blocks": True}),
        ("admit_remote_kv", ("a",), {"first_token_id": 7}),
        ("step", (), {}),
        ("add_request", ("b", [], None), {}),  # sent first: it raises on every rank alike
    ]


def test_a_follower_makes_the_calls_in_order_and_drops_a_failed_one():
    core = Recorder()
    follow(core, Pipe([("add_request", ("b", [], None), {}), ("add_request", ("a", [3], None), {}),
                       ("step", (), {}), ShutdownMsg(), ("step", (), {})]))
    assert core.calls == [("add_request", "b", (), False), ("add_request", "a", (3,), False), ("step",)]
    assert core.outputs_taken == 3
    follow(core, Pipe([]))  # rank 0 gone: the follower ends


def test_a_follower_ends_on_a_step_that_raises():
    core = Recorder()
    with pytest.raises(RuntimeError, match="collective timed out"):
        follow(core, Pipe([("admit_remote_kv", ("a", 1), {})] * 4 + [("step", (), {})] * 3))
    assert core.calls[-1] == ("step",) and len(core.calls) == 6
