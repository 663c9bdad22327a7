"""Upstream request fields this server does not implement: refused with a 400 naming the field, or
listed as harmless and ignored. Never silently dropped. A field no upstream API has is accepted and
ignored, as vLLM's `extra="allow"` does, and logged once per server (`unknown_fields`).

vLLM's and SGLang's request types have many more fields than the ones we honour (bodies.py). Each
field here is refused when it holds anything but its neutral values (what upstream does when the
field is absent), so clients that send defaults explicitly still work. docs/api.md holds the table;
tests/component/test_upstream_fields.py walks upstream's field lists against it.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from disagg.api.bodies import decode_body
from disagg.http_edge import BadRequest

Neutral = tuple[object, ...]
_OFF: Neutral = (None, False)
_NONE: Neutral = (None,)
_EMPTY: Neutral = (None, [], {}, "")

# OpenAI/vLLM completions and chat (top level of the body).
OPENAI_REFUSED: Mapping[str, Neutral] = {
    "spaces_between_special_tokens": (None, True),
    "prompt_embeds": _EMPTY, "logits_processors": _EMPTY,
    "vllm_xargs": _EMPTY, "max_repetition_pattern_size": (None, 0), "min_repetition_pattern_size": (None, 0),
    "repetition_min_count": (None, 0), "mm_processor_kwargs": _EMPTY, "documents": _EMPTY, "chat_template": _EMPTY,
    "reasoning_effort": _NONE,
    "include_reasoning": (None, True), "tools": _EMPTY, "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None, True),
    "audio": _NONE, "modalities": (None, ["text"]), "prediction": _NONE, "service_tier": (None, "auto", "default"),
    "store": _OFF, "metadata": _EMPTY, "web_search_options": _NONE, "functions": _EMPTY, "function_call": (None, "none"),
    "verbosity": _NONE,
}
# Accepted and without effect on the output. `cache_salt`: the prefix cache is shared by every request
# (docs/api.md says so; a tenant needing isolation runs its own server). `priority` is a body field
# (bodies.py): it orders the engine's queue under --scheduling-policy priority.
OPENAI_IGNORED = frozenset({"user", "safety_identifier", "prompt_cache_key", "cache_salt"})
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})  # chat honours them (tools.py)
CHAT_REFUSED: Mapping[str, Neutral] = {**{k: v for k, v in OPENAI_REFUSED.items() if k not in TOOL_FIELDS},
                                       "echo": _OFF}  # vLLM's chat echo (prepend the last message)

# vLLM's ResponsesRequest (POST /v1/responses, top level). `include` asks for hosted tools' outputs,
# logprobs or encrypted reasoning; `reasoning` for a reasoning model's effort; `truncation` "auto" for
# dropping the start of a conversation; `prompt` for a stored prompt template: none is built here.
RESPONSES_REFUSED: Mapping[str, Neutral] = {
    "include": _EMPTY, "max_tool_calls": _NONE, "prompt": _EMPTY, "reasoning": _EMPTY,
    "service_tier": (None, "auto", "default"), "top_logprobs": (None, 0), "truncation": (None, "disabled"),
    "media_io_kwargs": _EMPTY, "mm_processor_kwargs": _EMPTY, "enable_response_messages": _OFF,
    "previous_input_messages": _EMPTY, "vllm_xargs": _EMPTY,
}
RESPONSES_IGNORED = frozenset({"prompt_cache_key", "cache_salt", "safety_identifier"})  # as OPENAI_IGNORED

# vLLM SamplingParams (the `sampling_params` of /inference/v1/generate).
VLLM_SAMPLING_REFUSED: Mapping[str, Neutral] = {
    "prompt_logprob_token_ids": _EMPTY, "prompt_logprob_start": _NONE, "logprob_token_ids": _EMPTY,
    "flat_logprobs": _OFF, "detokenize": (None, True), "spaces_between_special_tokens": (None, True),
    "output_kind": (None, 0, 1, 2), "stream_interval": (None, 1), "logits_processors": _EMPTY,
    "extra_args": _EMPTY, "skip_reading_prefix_cache": _OFF,
    "thinking_token_budget": _NONE, "repetition_detection": _NONE, "routed_experts_prompt_start": (None, 0),
    "trace_decode_token_ids": _EMPTY,
}
VLLM_SAMPLING_IGNORED = frozenset({"skip_clone"})  # an in-process copy hint
# vLLM's GenerateRequest (top level of /inference/v1/generate).
TOKENS_REFUSED: Mapping[str, Neutral] = {"features": _EMPTY}
TOKENS_IGNORED = frozenset({"cache_salt"})  # as OPENAI_IGNORED
# Owned by the P/D layer (the pull flow's ticket), not by the sampling front: neither refused nor ignored here.
PD_FIELDS = frozenset({"kv_transfer_params"})

# SGLang's GenerateReqInput (top level of /generate).
SGLANG_REFUSED: Mapping[str, Neutral] = {
    "session_id": _EMPTY, "input_embeds": _EMPTY, "image_data": _EMPTY, "video_data": _EMPTY, "audio_data": _EMPTY,
    "mm_hashes": _EMPTY, "mm_content_hashes": _EMPTY, "use_audio_in_video": _OFF, "video_config": _EMPTY,
    "return_sampling_mask": _OFF, "return_flat_raw_top_logprobs": _OFF,
    "return_flat_raw_top_logprobs_b64": _OFF, "return_hidden_states": _OFF, "return_routed_experts": _OFF,
    "routed_experts_start_len": (None, 0), "return_indexer_topk": _OFF, "session_params": _EMPTY,
    "lora_path": _EMPTY, "lora_id": _EMPTY, "custom_logit_processor": _EMPTY, "positional_embed_overrides": _EMPTY,
    "background": _OFF, "require_reasoning": _OFF, "max_thinking_tokens": _NONE, "return_bytes": _OFF,
    "return_entropy": _OFF, "max_dynamic_patch": _NONE, "min_dynamic_patch": _NONE, "image_max_dynamic_patch": _NONE,
    "video_max_dynamic_patch": _NONE, "images_config": _EMPTY, "multi_item_delimiter_indices": _EMPTY,
    "extra_key": _EMPTY, "modalities": _EMPTY, "return_prompt_token_ids": _OFF,
}
SGLANG_IGNORED = frozenset({  # router hints and logging switches, plus cache_salt as OPENAI_IGNORED
    "log_metrics", "cache_salt", "bootstrap_pair_key", "decode_tp_size",
    "kv_router_hint", "routing_key",
    "conversation_id", "http_worker_ipc", "no_logs", "custom_labels", "external_trace_header", "received_time",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
})

# SGLang's SamplingParams (the `sampling_params` of /generate).
SGLANG_SAMPLING_REFUSED: Mapping[str, Neutral] = {
    "stop_regex": _EMPTY, "structural_tag": _EMPTY, "spaces_between_special_tokens": (None, True),
    "custom_params": _EMPTY,
}
SGLANG_SAMPLING_IGNORED = frozenset({"stream_interval"})  # every token is streamed as it comes


def check_upstream(raw: bytes, refused: Mapping[str, Neutral], struct: type[msgspec.Struct],
                   nested: tuple[str, Mapping[str, Neutral], type[msgspec.Struct]] | None = None) -> None:
    """Refuse what `raw` (a body that already decoded as `struct`) sets among the `refused` fields
    `struct` does not know; `nested` names a sub-object (`sampling_params`) checked likewise.
    Only those fields are decoded (other values were checked by `struct`, or are ignored)."""
    probe = _probe(refused, None if nested is None else nested[:2])
    body = decode_body(raw, probe)
    refuse_unsupported(_set_fields(body), refused, struct)
    if nested is not None:
        name, nested_refused, nested_struct = nested
        inner = getattr(body, name)
        for item in inner if isinstance(inner, list) else [] if inner is None else [inner]:
            refuse_unsupported(_set_fields(item), nested_refused, nested_struct, prefix=f"{name}.")


_PROBES: dict[tuple[int, int | None], type[msgspec.Struct]] = {}


def _probe(refused: Mapping[str, Neutral], nested: tuple[str, Mapping[str, Neutral]] | None) -> type[msgspec.Struct]:
    """A struct of only the refused fields (and the nested object's), built once per table."""
    key = (id(refused), None if nested is None else id(nested[1]))
    if key not in _PROBES:
        fields = [(name, object, msgspec.UNSET) for name in refused]
        if nested is not None:
            inner = msgspec.defstruct("NestedProbe", [(n, object, msgspec.UNSET) for n in nested[1]], kw_only=True)
            fields.append((nested[0], inner | list[inner] | None, None))  # a batch has a list
        _PROBES[key] = msgspec.defstruct("Probe", fields, kw_only=True)
    return _PROBES[key]


def _set_fields(probe: msgspec.Struct) -> dict[str, object]:
    return {name: getattr(probe, name) for name in probe.__struct_fields__
            if getattr(probe, name) is not msgspec.UNSET}


def refuse_unsupported(body: object, refused: Mapping[str, Neutral], struct: type[msgspec.Struct],
                       prefix: str = "") -> None:
    """400 naming the first field of `refused` that `body` sets to a value other than its neutral
    ones, unless `struct` has that field (then the route honours it)."""
    if not isinstance(body, dict):
        return
    known = set(struct.__struct_fields__)
    for name, neutral in refused.items():
        if name in body and name not in known and not _is_neutral(body[name], neutral):
            raise BadRequest(f"{prefix}{name} is not supported by this server (got {_short(body[name])}); "
                             "leave it unset", name)


def _is_neutral(value: object, neutral: Neutral) -> bool:
    return any(value == n and type(value) is type(n) or (value is None and n is None) or
               (isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(n, (int, float))
                and not isinstance(n, bool) and value == n)
               for n in neutral)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def unknown_fields(raw: bytes, struct: type[msgspec.Struct], *known: Mapping[str, object] | frozenset[str]) -> list[str]:
    """The top-level fields of `raw` (a JSON object that decoded as `struct`) that neither `struct` nor
    any of the `known` tables names: accepted and ignored, as vLLM's `extra="allow"` does (the route
    logs them once)."""
    try:  # the keys only: the values stay unparsed (cheap; a 1e999 the typed decode ignored stays unread)
        body = msgspec.json.decode(raw, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError:
        return []
    names = set(struct.__struct_fields__).union(*known)
    return [name for name in body if name not in names]
