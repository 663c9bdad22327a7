"""Request bodies of the generate endpoints, as msgspec structs.

Decoding checks every known field's type; unknown fields (routers add `log_metrics`, `rid`,
`return_hidden_states`, `bootstrap_*`, ...) are ignored. Every field is nullable, as in OpenAI's
API: `null` means "the default", and the defaults live in requests.py, one place per endpoint.
Fields whose JSON type varies (`prompt`, `text`, `input_ids`, `rid`, `messages`) are `object` here and
are checked in requests.py. Every integer is bounded to what the worker messages carry (64 bits), so
no value overflows downstream; seeds stay unbounded here so SamplingParams names their range.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

import msgspec

from disagg.http_edge import decode_json

T = TypeVar("T")
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Room = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]  # as SGLang draws them (63 bits)


class StreamOptions(msgspec.Struct, kw_only=True):
    """OpenAI's `stream_options`; vLLM adds `continuous_usage_stats` (usage on every chunk)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class RoutedBody(msgspec.Struct, kw_only=True):
    """DP routing and P/D fields, accepted on every generate endpoint (docs/api.md).

    Decoded from the same body as the endpoint's own struct, so every endpoint reads them alike.
    """

    routed_dp_rank: Int64 | None = None
    data_parallel_rank: Int64 | None = None  # deprecated alias of routed_dp_rank
    disagg_prefill_dp_rank: Int64 | None = None
    # A batch carries one room per prompt: lists, as sgl-model-gateway sends them.
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: Port | list[Port | None] | None = None
    bootstrap_room: Room | list[Room] | None = None
    kv_transfer_params: dict | None = None  # pull flow (vLLM's NixlConnector): passed to the worker as is
    disagg_prefill_here: bool = False  # a decode: prefill the whole prompt here (our router, with no prefill serving)


class SamplingFields(msgspec.Struct, kw_only=True):
    """Sampling fields whose name and meaning are the same in OpenAI's and vLLM's APIs."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool | None = None
    min_tokens: Int64 | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    n: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[Int64] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int64 | None = None  # keep the prompt's last (truncation_side "right": first) N tokens
    truncation_side: str | None = None
    response_format: object = None  # checked in structured.py
    structured_outputs: object = None
    guided_json: object = None  # vLLM's older spellings of structured_outputs' keys
    guided_regex: object = None
    guided_choice: object = None
    guided_grammar: object = None


class OpenAIBody(SamplingFields, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Int64 | None = None
    request_id: str | None = None
    add_special_tokens: bool | None = None
    priority: Int64 | None = None  # scheduling (vLLM's): lower first under --scheduling-policy priority
    prompt_logprobs: Int64 | None = None  # vLLM's: the top-n of each prompt token (the answer's `prompt_logprobs`)
    return_token_ids: bool | None = None  # vLLM's: the answer carries `prompt_token_ids` and each choice's `token_ids`
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens `token_id:<id>`
    regex: str | None = None  # SGLang's constraints on its OpenAI routes (at most one; structured.from_sglang)
    ebnf: str | None = None
    json_schema: str | None = None
    use_beam_search: bool | None = None  # vLLM's: n beams (api/beams.py), scored with length_penalty
    length_penalty: float | None = None


class CompletionBody(OpenAIBody, kw_only=True):
    """/v1/completions: `logprobs` is a count; `echo`, `best_of` > 1 and `suffix` are refused."""

    prompt: object = None
    logprobs: Int64 | None = None
    echo: bool | None = None
    best_of: Int64 | None = None
    suffix: str | None = None


class ChatBody(OpenAIBody, kw_only=True):
    """/v1/chat/completions: `logprobs` is a flag, `top_logprobs` the count."""

    messages: object = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = None
    top_logprobs: Int64 | None = None
    chat_template_kwargs: dict[str, object] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    tools: object = None  # checked in tools.py
    tool_choice: object = msgspec.UNSET  # absent: "auto" when there are tools
    parallel_tool_calls: bool | None = None


class SGLangSampling(msgspec.Struct, kw_only=True):
    """SGLang's `sampling_params` fields that the engine implements. `max_new_tokens` absent (UNSET)
    keeps SGLang's default; `null` is the rest of the context, as SGLang's scheduler treats it."""

    max_new_tokens: Int64 | None | msgspec.UnsetType = msgspec.UNSET
    min_new_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    sampling_seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class SGLangBody(msgspec.Struct, kw_only=True):
    """SGLang's `/generate`: one prompt, or a batch (`text` a list of strings, `input_ids` a list of
    lists). Per-prompt fields take one value for every prompt or a list with one per prompt."""

    text: object = None
    input_ids: object = None
    sampling_params: SGLangSampling | list[SGLangSampling] | None = None
    stream: bool | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: Int64 | list[Int64] | None = None
    top_logprobs_num: Int64 | list[Int64] | None = None
    return_text_in_logprobs: bool | None = None
    token_ids_logprob: object = None  # token ids, or (a batch) one list of them per prompt
    rid: object = None
    priority: Int64 | None = None  # every prompt of a batch alike


class TokensSampling(SamplingFields, kw_only=True):
    """vLLM SamplingParams fields that the engine implements."""

    max_tokens: Int64 | None = None
    logprobs: Int64 | None = None
    prompt_logprobs: Int64 | None = None


class TokensBody(msgspec.Struct, kw_only=True):
    """vLLM's tokens-in/tokens-out `/inference/v1/generate`."""

    token_ids: list[int] | None = None
    sampling_params: TokensSampling | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    request_id: str | None = None
    priority: Int64 | None = None
    model: str | None = None


def decode_body(raw: bytes, kind: type[T]) -> T:
    """Decode a JSON object into `kind`; malformed JSON and wrong types are 400s naming the field."""
    return decode_json(raw, kind, malformed="malformed JSON body")
