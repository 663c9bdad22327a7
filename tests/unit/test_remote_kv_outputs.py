"""A decode-side request whose first token (computed by the prefill) already ends it still owes its
final output: the worker steps for it instead of waiting for another request to come along."""

import pytest

from disagg.config import CacheConfig, EngineConfig, ModelConfig
from disagg.engine.core import EngineCore
from disagg.engine.models.tiny import EOS_ID
from disagg.types import FinishReason, SamplingParams


@pytest.fixture
def core(tiny_loaded):
    config = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"), cache=CacheConfig(block_size=4, num_blocks=32))
    return EngineCore(config, tiny_loaded)


@pytest.mark.parametrize("first_token_id, params, reason", [
    (EOS_ID, SamplingParams(max_tokens=4), FinishReason.STOP),
    (42, SamplingParams(max_tokens=1), FinishReason.LENGTH),
])
def test_a_first_token_that_ends_the_request_is_delivered_by_the_next_step(core, first_token_id, params, reason):
    assert core.reserve_for_remote_kv("r", [5, 6, 7], params) == [0]
    core.admit_remote_kv("r", first_token_id)
    assert core.has_unfinished()  # the worker loop steps only while this is true
    [out] = core.step()
    assert (out.request_id, out.outputs.token_ids, out.outputs.finish_reason) == ("r", [first_token_id], reason)
    assert not core.has_unfinished() and core.kv.num_free_blocks == 32
