"""Every request field of vLLM's and SGLang's generate APIs is honoured, refused (400 naming it) or
listed as harmless and ignored: none is dropped silently.

The field lists are copied from upstream's source: vLLM's ChatCompletionRequest
(vllm/entrypoints/openai/chat_completion/protocol.py), CompletionRequest
(vllm/entrypoints/openai/completion/protocol.py), GenerateRequest
(vllm/entrypoints/serve/disagg/protocol.py) and SamplingParams (vllm/sampling_params.py); SGLang's
GenerateReqInput (python/sglang/srt/managers/io_struct.py) and SamplingParams
(python/sglang/srt/sampling/sampling_params.py); vLLM's ResponsesRequest
(vllm/entrypoints/openai/responses/protocol.py). A field upstream adds later fails this test until it
is classified.
"""

import pytest
from fake_engine import FakeEngine, api_client
from structlog.testing import capture_logs

from disagg.api import upstream_fields as uf
from disagg.api.bodies import ChatBody, CompletionBody, RoutedBody, SGLangBody, SGLangSampling, TokensBody, TokensSampling
from disagg.api.responses import ResponsesBody

pytestmark = pytest.mark.timeout(60)

VLLM_CHAT = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n
presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice reasoning_effort
include_reasoning parallel_tool_calls user use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
prompt_logprobs allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens
documents chat_template chat_template_kwargs mm_processor_kwargs structured_outputs priority request_id
logits_processors return_tokens_as_token_ids return_token_ids cache_salt kv_transfer_params vllm_xargs
max_repetition_pattern_size min_repetition_pattern_size repetition_min_count""".split()
VLLM_COMPLETION = """model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream
stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty length_penalty stop_token_ids
include_stop_str_in_output ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens
allowed_token_ids prompt_logprobs prompt_embeds add_special_tokens response_format structured_outputs priority request_id
logits_processors return_tokens_as_token_ids return_token_ids cache_salt kv_transfer_params vllm_xargs
max_repetition_pattern_size min_repetition_pattern_size repetition_min_count""".split()
VLLM_GENERATE = "request_id token_ids features sampling_params model stream stream_options cache_salt priority kv_transfer_params".split()
VLLM_SAMPLING = """n presence_penalty frequency_penalty repetition_penalty temperature top_p top_k min_p seed stop
stop_token_ids ignore_eos max_tokens min_tokens logprobs prompt_logprobs prompt_logprob_token_ids prompt_logprob_start
logprob_token_ids flat_logprobs detokenize skip_special_tokens spaces_between_special_tokens include_stop_str_in_output
output_kind stream_interval skip_clone structured_outputs logit_bias allowed_token_ids extra_args bad_words
skip_reading_prefix_cache thinking_token_budget repetition_detection routed_experts_prompt_start
trace_decode_token_ids""".split()
SGLANG_GENERATE = """rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes
mm_content_hashes use_audio_in_video video_config sampling_params return_logprob logprob_start_len top_logprobs_num
token_ids_logprob return_sampling_mask return_text_in_logprobs return_flat_raw_top_logprobs
return_flat_raw_top_logprobs_b64 stream log_metrics return_hidden_states return_routed_experts routed_experts_start_len
return_indexer_topk modalities session_params lora_path lora_id custom_logit_processor positional_embed_overrides
bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank
disagg_prefill_dp_rank kv_router_hint routing_key conversation_id http_worker_ipc background require_reasoning
max_thinking_tokens priority extra_key no_logs custom_labels return_bytes return_entropy return_prompt_token_ids
external_trace_header received_time need_wait_for_mm_inputs num_items_assigned encoder_urls max_dynamic_patch
min_dynamic_patch image_max_dynamic_patch video_max_dynamic_patch images_config multi_item_delimiter_indices
cache_salt""".split()
SGLANG_SAMPLING = """max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty
presence_penalty repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens
spaces_between_special_tokens no_stop_trim custom_params stream_interval logit_bias sampling_seed""".split()

VLLM_RESPONSES = """background include input instructions max_output_tokens max_tool_calls metadata model logit_bias
parallel_tool_calls previous_response_id prompt reasoning service_tier store stream temperature text tool_choice tools
top_logprobs top_p top_k truncation user skip_special_tokens include_stop_str_in_output prompt_cache_key request_id
media_io_kwargs mm_processor_kwargs priority cache_salt kv_transfer_params enable_response_messages chat_template_kwargs
previous_input_messages structured_outputs repetition_penalty seed stop ignore_eos vllm_xargs""".split()

CHAT_BASE = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2}
ROUTED = set(RoutedBody.__struct_fields__)

# (name, upstream fields, our struct, refused table, ignored set, make a body that sets `field` to `value`)
SURFACES = [
    ("chat", VLLM_CHAT, ChatBody, uf.CHAT_REFUSED, uf.OPENAI_IGNORED, "/v1/chat/completions",
     lambda f, v: {**CHAT_BASE, f: v}),
    ("completions", VLLM_COMPLETION, CompletionBody, uf.OPENAI_REFUSED, uf.OPENAI_IGNORED, "/v1/completions",
     lambda f, v: {"prompt": "a", "max_tokens": 2, f: v}),
    ("tokens", VLLM_GENERATE, TokensBody, uf.TOKENS_REFUSED, uf.TOKENS_IGNORED, "/inference/v1/generate",
     lambda f, v: {"token_ids": [1], f: v}),
    ("tokens.sampling_params", VLLM_SAMPLING, TokensSampling, uf.VLLM_SAMPLING_REFUSED, uf.VLLM_SAMPLING_IGNORED,
     "/inference/v1/generate", lambda f, v: {"token_ids": [1], "sampling_params": {"max_tokens": 2, f: v}}),
    ("generate", SGLANG_GENERATE, SGLangBody, uf.SGLANG_REFUSED, uf.SGLANG_IGNORED, "/generate",
     lambda f, v: {"text": "a", f: v}),
    ("responses", VLLM_RESPONSES, ResponsesBody, uf.RESPONSES_REFUSED, uf.RESPONSES_IGNORED, "/v1/responses",
     lambda f, v: {"input": "a", "max_output_tokens": 2, f: v}),
    ("generate.sampling_params", SGLANG_SAMPLING, SGLangSampling, uf.SGLANG_SAMPLING_REFUSED, uf.SGLANG_SAMPLING_IGNORED,
     "/generate", lambda f, v: {"text": "a", "sampling_params": {"max_new_tokens": 2, f: v}}),
]


@pytest.mark.parametrize("surface", SURFACES, ids=[s[0] for s in SURFACES])
def test_every_upstream_field_is_classified(surface):
    name, fields, struct, refused, ignored, _, _ = surface
    honoured = set(struct.__struct_fields__) | (ROUTED if "." not in name else set())
    unclassified = [f for f in fields if f not in honoured | set(refused) | ignored | uf.PD_FIELDS]
    assert unclassified == []
    both = [f for f in fields if f in set(struct.__struct_fields__) and (f in refused or f in ignored)]
    assert both == []  # a field the route honours is neither refused nor ignored


CASES = [(s[0], s[5], s[6], f, neutral) for s in SURFACES for f, neutral in s[3].items() if f in s[1]
         and f not in s[2].__struct_fields__]


@pytest.mark.parametrize("surface, path, make, field, neutral", CASES, ids=[f"{c[0]}.{c[3]}" for c in CASES])
async def test_refused_fields_are_400_naming_them_and_neutral_values_pass(surface, path, make, field, neutral):
    value = False if True in [n for n in neutral if n is True] else {"poke": 1}
    async with api_client(FakeEngine()) as client:
        resp = await client.post(path, json=make(field, value))
        got = await resp.json()
        assert resp.status == 400, got
        assert got["error"]["param"] == field and "is not supported by this server" in got["error"]["message"]
        resp = await client.post(path, json=make(field, neutral[-1]))
        assert resp.status == 200, await resp.text()


@pytest.mark.parametrize("surface", SURFACES, ids=[s[0] for s in SURFACES])
async def test_ignored_fields_are_accepted(surface):
    name, fields, _, _, ignored, path, make = surface
    async with api_client(FakeEngine()) as client:
        for field in sorted(f for f in fields if f in ignored):
            resp = await client.post(path, json=make(field, "x"))
            assert resp.status == 200, (field, await resp.text())


def test_unknown_fields_are_exactly_those_no_table_names():
    known = (uf.OPENAI_REFUSED, uf.OPENAI_IGNORED, uf.PD_FIELDS, RoutedBody.__struct_fields__)
    body = b'{"prompt": "a", "zz": 1e999, "bootstrap_room": 3, "user": "u", "use_beam_search": false, "q": {}}'
    assert uf.unknown_fields(body, CompletionBody, *known) == ["zz", "q"]
    assert uf.unknown_fields(b'[1, 2]', CompletionBody, *known) == []


async def test_vllms_sampling_fields_on_responses_reach_the_engine_as_on_chat():
    """vLLM's extra sampling fields of /v1/responses are the chat's: the same SamplingParams as the chat request
    with the same fields; structured_outputs beside a text.format is refused in vLLM's words."""
    extra = {"top_k": 7, "repetition_penalty": 1.2, "stop": ["zz"], "ignore_eos": True, "logit_bias": {"5": 1.0},
             "skip_special_tokens": False, "include_stop_str_in_output": True, "priority": 0,
             "structured_outputs": {"choice": ["yes", "no"]}}
    engine = FakeEngine()
    async with api_client(engine) as client:
        body = {"input": "a", "max_output_tokens": 2, "temperature": 0, **extra}
        resp = await client.post("/v1/responses", json=body)
        assert resp.status == 200, await resp.text()
        resp = await client.post("/v1/chat/completions", json={**CHAT_BASE, "temperature": 0, **extra})
        assert resp.status == 200, await resp.text()
        resp = await client.post("/v1/responses", json={"input": "a", "structured_outputs": {"choice": ["y"]},
                                                        "text": {"format": {"type": "json_object"}}})
        got = await resp.json()
    (responses, _), (chat, _) = engine.requests
    assert responses.sampling == chat.sampling
    assert (responses.sampling.top_k, responses.sampling.stop, responses.sampling.ignore_eos) == (7, ("zz",), True)
    assert (resp.status, got["error"]["param"], got["error"]["message"]) == (
        400, "structured_outputs", "Cannot specify both structured_outputs and text.format")


async def test_unknown_fields_are_served_and_logged_once_per_server():
    """A field no API we follow names (`zz`) is accepted and logged once per server and field, on chat and on
    /v1/responses alike; an ignored one (`cache_salt`), and Responses' `background` at its neutral false, are not."""
    with capture_logs() as logs:
        async with api_client(FakeEngine()) as client:
            for _ in range(2):
                for path, body in (("/v1/chat/completions", CHAT_BASE),
                                   ("/v1/responses", {"input": "a", "background": False})):
                    resp = await client.post(path, json={**body, "zz": 1, "cache_salt": "s"})
                    assert resp.status == 200, await resp.text()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
        "request field 'zz' is not known to this server and is ignored, as vLLM ignores unknown fields"]
