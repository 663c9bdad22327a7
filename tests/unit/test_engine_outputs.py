"""Outputs the engine owes: a decode-side request whose first token (computed by the prefill) already
ends it is delivered by the next step; a request id reused right after an abort belongs to the new
request alone."""

import pytest

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
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
    reservation = core.reserve_for_remote_kv("r", [5, 6, 7], params)
    assert (reservation.block_ids, reservation.num_cached_tokens, reservation.new_block_ids) == ([0], 0, [0])
    core.admit_remote_kv("r", first_token_id)
    assert core.has_unfinished()  # the worker loop steps only while this is true
    [out] = core.step()
    assert (out.request_id, out.outputs.token_ids, out.outputs.finish_reason) == ("r", [first_token_id], reason)
    assert not core.has_unfinished() and core.kv.num_free_blocks == 32


def run(core, request_id: str, prompt: list[int], params: SamplingParams) -> list:
    core.add_request(request_id, prompt, params)
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    return outputs


def test_a_request_id_reused_right_after_an_abort_belongs_to_the_new_request(core):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    [fresh] = [o for o in run(core, "other", [9, 8, 7], params) if o.finished]
    core.add_request("hdr", [5, 6, 7], params)
    core.step()
    assert core.abort("hdr")  # e.g. the client left; the front sees the abort and forgets the id
    assert [o.outputs.finish_reason for o in core.take_outputs()] == [FinishReason.ABORT]
    # A client sends the same id again (X-Request-Id) before the engine drained the aborted request.
    outputs = run(core, "hdr", [9, 8, 7], params)
    assert [(o.request_id, o.outputs.finish_reason) for o in outputs if o.finished] == [("hdr", FinishReason.LENGTH)]
    assert outputs[-1].outputs.token_ids == fresh.outputs.token_ids  # its own tokens, none of the aborted one's
    assert core.kv.num_free_blocks == 32 and core.outputs.streams == {}
