"""Admission: input that could make an engine step raise, or that cannot fit the context, is refused
with a typed error before it reaches a batch; one request's bad input never stops a worker."""

import math

import pytest

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
from disagg.worker.unified import UnifiedRole
from disagg.worker.process import apply
from disagg.engine.core import EngineCore
from disagg.types import SEED_MAX, SEED_MIN, FinishReason, InvalidRequest, SamplingParams
from disagg.wire.engine_msgs import AbortMsg, GenerateMsg, OutputMsg
from engine_runs import run_requests

CONTEXT = 512  # the tiny model's max_position_embeddings
VLLM_CONTEXT_MESSAGE = (
    "This model's maximum context length is 512 tokens. However, you requested 513 tokens (10 in the messages, "
    "503 in the completion). Please reduce the length of the messages or completion."
)


@pytest.fixture
def core(tiny_loaded):
    config = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"), cache=CacheConfig(block_size=4, num_blocks=256))
    return EngineCore(config, tiny_loaded)


def generate(core, prompt, params) -> list[int]:
    return run_requests(core, [(prompt, params)])[0].outputs.token_ids


# ---- SamplingParams --------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_float_params_must_be_finite(field, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert (err.value.message, err.value.param) == (f"{field} must be a finite number, got {value!r}", field)


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-38, True), (9.99e-6, True), (1e-5, False), (0.7, False)])
def test_a_temperature_below_1e_5_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize("seed", [2**63, 2**70, -(2**63) - 1])
def test_seeds_must_be_signed_64_bit(seed):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(seed=seed)
    assert (err.value.message, err.value.param) == (
        f"seed must be an integer between -9223372036854775808 and 9223372036854775807 (64-bit signed), got {seed}", "seed")


def test_unset_max_tokens_bounds_min_tokens_by_the_default():
    assert (SamplingParams().max_tokens, SamplingParams().default_max_tokens) == (None, 16)  # vLLM's 16, as a default
    params = SamplingParams(default_max_tokens=None, min_tokens=10**6)  # no default: the context decides
    assert (params.max_tokens, params.min_tokens) == (None, 10**6)
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(min_tokens=17)
    assert (err.value.message, err.value.param) == ("min_tokens must be between 0 and max_tokens (16), got 17", "min_tokens")
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(max_tokens=None, default_max_tokens=0)
    assert (err.value.message, err.value.param) == ("default_max_tokens must be at least 1, got 0", "default_max_tokens")


# ---- the engine's admission ------------------------------------------------------------------


def test_a_stop_token_id_out_of_vocabulary_is_refused(core):
    with pytest.raises(InvalidRequest) as err:
        core.add_request("r", [5, 6, 7], SamplingParams(min_tokens=2, stop_token_ids=[999999999]))
    assert (err.value.message, err.value.param) == (
        "stop token id 999999999 is out of vocabulary (vocab_size=320)", "stop_token_ids")
    assert not core.has_unfinished() and core.kv.num_free_blocks == 256


def test_max_tokens_that_overflow_the_context_are_refused_with_vllms_message(core):
    with pytest.raises(InvalidRequest) as err:
        core.add_request("r", list(range(1, 11)), SamplingParams(max_tokens=503))
    assert (err.value.message, err.value.param) == (VLLM_CONTEXT_MESSAGE, "max_tokens")
    with pytest.raises(InvalidRequest) as err:
        core.add_request("r", list(range(1, 11)), SamplingParams(max_tokens=2**62))
    assert err.value.message.startswith("This model's maximum context length is 512 tokens. However, you requested "
                                        f"{10 + 2**62} tokens (10 in the messages, {2**62} in the completion).")
    core.add_request("fits", list(range(1, 11)), SamplingParams(max_tokens=502))  # exactly the context
    assert core.scheduler.requests["fits"].sampling_params.max_tokens == 502


@pytest.mark.parametrize("default, resolved", [(None, 502), (16, 16), (600, 502)])
def test_unset_max_tokens_resolve_to_the_default_capped_by_the_context(core, default, resolved):
    core.add_request("r", list(range(1, 11)), SamplingParams(max_tokens=None, default_max_tokens=default))
    assert core.scheduler.requests["r"].sampling_params.max_tokens == resolved


def test_the_default_of_the_python_api_is_capped_by_the_context_never_refused(core):
    core.add_request("r", [5] * 500, SamplingParams())  # 500 + 16 > 512: the default stops at 12
    assert core.scheduler.requests["r"].sampling_params.max_tokens == 12


def test_min_tokens_past_the_context_are_refused_when_max_tokens_is_unset(core):
    with pytest.raises(InvalidRequest) as err:
        core.add_request("r", list(range(1, 11)), SamplingParams(default_max_tokens=None, min_tokens=503))
    assert (err.value.message, err.value.param) == (
        "min_tokens is 503, but the prompt has 10 tokens and the context length is 512: at most 502 tokens can be "
        "generated", "min_tokens")


def test_a_tiny_temperature_samples_greedily_instead_of_nan(core):
    greedy = generate(core, [5, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tiny = generate(core, [5, 6, 7], SamplingParams(max_tokens=8, temperature=1e-38, ignore_eos=True))
    assert tiny == greedy and len(greedy) == 8


@pytest.mark.parametrize("seed", [SEED_MIN, SEED_MAX])
def test_the_whole_seed_range_seeds_a_generator(core, seed):
    first = generate(core, [5, 6, 7], SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True))
    again = generate(core, [5, 6, 7], SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True))
    assert first == again and len(first) == 6


# ---- the worker goes on ----------------------------------------------------------------------


def chat(request_id: str, content: object, max_tokens: int | None = 4) -> GenerateMsg:
    return GenerateMsg(request_id, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       messages=[{"role": "user", "content": content}], add_special_tokens=False)


async def test_an_unexpected_admission_error_answers_500_and_the_role_goes_on(core):
    role = UnifiedRole(core, 0, "tiny")
    # A content list the front did not flatten makes the chat template raise TypeError.
    [out] = await role.submit(chat("bad", [{"type": "text", "text": "hi"}]))
    assert out == OutputMsg("bad", finish_reason=FinishReason.ABORT, error_status=500, error=(
        'the worker could not admit the request: TypeError: can only concatenate str (not "list") to str'))
    assert await role.submit(chat("good", "hi")) == []
    outputs = []
    while role.has_work():
        outputs += role.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finish_reason] == [("good", "length")]


async def test_admission_answers_a_refused_request_with_a_400_naming_the_field(core):
    role = UnifiedRole(core, 0, "tiny")
    [out] = await role.submit(GenerateMsg("big", SamplingParams(max_tokens=503), prompt_token_ids=list(range(1, 11))))
    assert out == OutputMsg("big", finish_reason=FinishReason.ABORT, error_status=400, error_param="max_tokens",
                            error=VLLM_CONTEXT_MESSAGE)


class RaisingRole(UnifiedRole):
    """A role whose own error handling has a bug: the worker loop is the last line of defence."""

    async def submit(self, msg):
        raise KeyError("boom")

    async def abort(self, request_id):
        raise KeyError("boom")


async def test_the_worker_loop_survives_a_role_that_raises(core):
    role = RaisingRole(core, 0, "tiny")
    assert await apply(role, chat("x", "hi")) == [OutputMsg(
        "x", finish_reason=FinishReason.ABORT, error_status=500, error="the worker could not admit the request: KeyError: 'boom'")]
    assert await apply(role, AbortMsg("x")) == []
