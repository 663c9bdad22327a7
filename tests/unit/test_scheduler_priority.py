"""The scheduling policies with exact request ids: fcfs (arrival order) and priority (vLLM's: the
waiting queue by (priority, arrival), the running request with the largest (priority, arrival)
preempted first)."""

import pytest

from disagg.engine_config import SchedulerConfig, SchedulingPolicy
from disagg.engine.kv_cache_manager import KVCacheManager
from disagg.engine.request import Request, RequestStatus
from disagg.engine.scheduler import SampledToken, Scheduler
from disagg.types import SamplingParams


def make(policy: str, num_blocks=16, max_seqs=8):
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64, scheduling_policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks, 4, False), 1000)


def req(rid, num_prompt, arrival, priority=0, max_tokens=20):
    return Request(rid, list(range(num_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                   priority=priority, arrival_time=arrival)


def step(sched):
    out = sched.schedule()
    sched.update(out, {s.request_id: SampledToken(50) for s in out.seqs if s.sample})
    return [s.request_id for s in out.seqs], out.preempted_ids


def test_the_policy_is_an_enum_from_its_value():
    assert SchedulerConfig(scheduling_policy="priority").scheduling_policy is SchedulingPolicy.PRIORITY
    assert SchedulerConfig().scheduling_policy is SchedulingPolicy.FCFS


@pytest.mark.parametrize("policy, order", [
    ("fcfs", [["a"], ["a"], ["b"], ["b"], ["c"], ["c"]]),
    ("priority", [["a"], ["a"], ["c"], ["c"], ["b"], ["b"]]),
])
def test_a_later_request_with_a_lower_priority_value_runs_first_when_the_batch_is_full(policy, order):
    sched = make(policy, max_seqs=1)
    sched.add(req("a", 4, 1.0, max_tokens=2))
    steps = [step(sched)[0]]
    sched.add(req("b", 4, 2.0, max_tokens=2))
    sched.add(req("c", 4, 3.0, priority=-1, max_tokens=2))
    while sched.has_work():
        steps.append(step(sched)[0])
    assert steps == order


def test_equal_priorities_keep_arrival_order_and_the_queue_sorts_by_priority_then_arrival():
    sched = make("priority", max_seqs=1)
    for rid, arrival, priority in [("a", 1.0, 0), ("b", 2.0, 3), ("c", 3.0, 0), ("d", 4.0, -2), ("e", 5.0, 3)]:
        sched.add(req(rid, 4, arrival, priority))
    assert [r.request_id for r in sched.waiting] == ["d", "a", "c", "b", "e"]


@pytest.mark.parametrize("policy, scheduled, preempted", [
    # fcfs: the last to start (b, the one asking) gives way; a runs on.
    ("fcfs", ["a"], ["b"]),
    # priority: a (priority 5) is the largest (priority, arrival): preempted although it started first and
    # was already scheduled in this step; b takes its block.
    ("priority", ["b"], ["a"]),
])
def test_out_of_blocks_preempts_by_the_policy(policy, scheduled, preempted):
    sched = make(policy, num_blocks=4)
    sched.add(req("a", 4, 1.0, priority=5))
    assert step(sched) == (["a"], [])  # a: block 0, 5 tokens
    sched.add(req("b", 7, 2.0, priority=0))
    assert step(sched) == (["a", "b"], [])  # a: block 1 (position 4); b: blocks 2, 3; none free
    assert step(sched) == (["a", "b"], [])  # a position 5, b position 7: in their blocks
    assert step(sched) == (scheduled, preempted)  # b position 8 needs a fifth block
    [victim] = preempted
    [survivor] = scheduled
    assert sched.requests[victim].status is RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == [victim] and [r.request_id for r in sched.running] == [survivor]
    assert sched.requests[victim].block_ids == [] and sched.kv.num_free_blocks == {"a": 1, "b": 2}[victim]
    assert sched.requests[survivor].block_ids == {"a": [2, 3, 1], "b": [0, 1]}[victim]
