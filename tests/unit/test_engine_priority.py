"""The engine on the tiny model under both scheduling policies: with `priority`, a request added later
with a lower priority value runs before the earlier ones waiting for a full batch."""

import pytest

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.core import EngineCore
from disagg.types import SamplingParams

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("policy, finish_order", [("fcfs", ["a", "b", "c"]), ("priority", ["a", "c", "b"])])
def test_priority_orders_the_waiting_requests_of_a_full_batch(tiny_loaded, policy, finish_order):
    config = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"),
                          cache=CacheConfig(block_size=4, num_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=1, scheduling_policy=policy))
    core = EngineCore(config, tiny_loaded)
    core.add_request("a", [5, 6, 7], PARAMS)
    first = core.step()
    assert [(o.request_id, o.finished) for o in first] == [("a", False)]  # a fills the batch
    core.add_request("b", [5, 6, 8], PARAMS, priority=0)
    core.add_request("c", [5, 6, 9], PARAMS, priority=-1)
    finished = []
    while core.has_unfinished():
        finished += [o.request_id for o in core.step() if o.finished]
    assert finished == finish_order
