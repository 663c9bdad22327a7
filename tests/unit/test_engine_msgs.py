"""The worker <-> front-door messages on the wire: states cross as Enums, encoded by their values;
sampling parameters as SamplingParams itself."""

import msgspec
import pytest

from disagg.types import FinishReason, GrammarKind, SamplingParams, StructuredOutput
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg, decode_from_worker, decode_to_worker, encode


@pytest.mark.parametrize("reason", list(FinishReason))
def test_a_finish_reason_crosses_as_its_value_and_comes_back_a_member(reason):
    data = encode(OutputMsg("r1", new_token_ids=[5], finish_reason=reason))
    assert data == (b"\xde\x00\x04\xa4type\xa6output\xaarequest_id\xa2r1\xadnew_token_ids\x91\x05"
                    b"\xadfinish_reason" + bytes([0xA0 + len(reason.value)]) + reason.value.encode())
    assert decode_from_worker(data).finish_reason is reason


def test_a_finish_reason_outside_the_enum_is_refused():
    data = encode(OutputMsg("r1", finish_reason=FinishReason.LENGTH)).replace(b"length", b"lenxth")
    with pytest.raises(msgspec.ValidationError, match=r"^Invalid enum value 'lenxth' - at `\$.finish_reason`$"):
        decode_from_worker(data)


def test_sampling_params_cross_as_themselves():
    """No mirror: every field of SamplingParams (nested StructuredOutput, its enum, tuples, int keys)
    comes back equal after the front -> worker hop."""
    sampling = SamplingParams(max_tokens=7, min_tokens=2, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=-3,
                              stop=["</s>", "x"], stop_token_ids=[2], ignore_eos=True, include_stop_str_in_output=True,
                              logprobs=3, prompt_logprobs=1, logprob_token_ids=[9, 8], skip_special_tokens=False,
                              default_max_tokens=None, presence_penalty=0.5, frequency_penalty=-0.5,
                              repetition_penalty=1.2, logit_bias={"5": 300}, allowed_token_ids=[1, 5],
                              bad_words=["a b"], structured_output=StructuredOutput(GrammarKind.REGEX, "a+", "regex"))
    back = decode_to_worker(encode(GenerateMsg("r1", sampling, prompt_token_ids=[1, 2])))
    assert back.sampling == sampling
    assert back.sampling.logit_bias == {5: 100.0} and back.sampling.structured_output.kind is GrammarKind.REGEX
    assert back.sampling.stop == ("</s>", "x") and back.sampling.allowed_token_ids == (1, 5)


def test_sampling_params_are_validated_again_when_a_worker_decodes_them():
    data = msgspec.msgpack.encode({"type": "generate", "request_id": "r1", "sampling": {"top_p": -0.5}})
    with pytest.raises(msgspec.ValidationError, match=r"^top_p must be in \(0, 1\], got -0.5 - at `\$.sampling`$"):
        decode_to_worker(data)
