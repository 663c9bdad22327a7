"""SGLang-native POST /generate: `text` or `input_ids`, `sampling_params`, `meta_info` answers.

Streaming follows SGLang: every `data:` event holds the cumulative `text` and `output_ids` so far,
then `data: [DONE]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from aiohttp import web

from disagg.api.batch import serve_batch
from disagg.api.bodies import SGLangBody, SGLangSampling, decode_body
from disagg.api.requests import (
    build_generate_msg,
    check_token_ids,
    choose_request_id,
    make_sampling,
    read_body,
    same_named,
)
from disagg.api.routing import read_routing
from disagg.api.parallel import check_n, merge_sglang, serve_choices
from disagg.api.sglang_render import LogprobFields, SGLangBatchRenderer, SGLangRenderer
from disagg.api.state import state_of
from disagg.api.structured import from_sglang
from disagg.api.upstream_fields import SGLANG_REFUSED, SGLANG_SAMPLING_REFUSED, check_upstream
from disagg.http_edge import BadRequest
from disagg.types import SAMPLING_FIELDS, SamplingParams
from disagg.wire.engine_msgs import GenerateMsg

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when the field is absent (capped by the context, never refused)


def sglang_prompts(body: SGLangBody, vocab_size: int) -> tuple[list[dict], bool]:
    """The prompts and whether the request is a batch: exactly one of `text` (a string, or a list
    of strings) and `input_ids` (token ids, or a list of token id lists)."""
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("send exactly one of text and input_ids", "text")
    if body.text is not None:
        if isinstance(body.text, list):
            if not body.text:
                raise BadRequest("text is an empty list: send a prompt or a non-empty batch of prompts", "text")
            return [{"prompt": _text(t, "text")} for t in body.text], True
        return [{"prompt": _text(body.text, "text")}], False
    ids = body.input_ids
    if isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids):
        return [{"prompt_token_ids": check_token_ids(i, vocab_size, "input_ids")} for i in ids], True
    return [{"prompt_token_ids": check_token_ids(ids, vocab_size, "input_ids")}], False


def _text(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{param} must be a non-empty string or a list of them", param)
    return value


def per_prompt(value: object, num_prompts: int, param: str) -> list:
    """A per-prompt field: one value for every prompt, or a list with one entry per prompt."""
    if isinstance(value, list):
        if len(value) != num_prompts:
            raise BadRequest(f"{param} has {len(value)} entries for {num_prompts} prompts: send one per prompt", param)
        return value
    return [value] * num_prompts


# SGLang's sampling_params fields named as SamplingParams names them (the others are mapped below).
SGLANG_SAMPLING = SAMPLING_FIELDS & frozenset(SGLangSampling.__struct_fields__)


def sglang_sampling(sp: SGLangSampling | None, fields: LogprobFields) -> SamplingParams:
    """SGLang's `sampling_params` (+ the logprob fields) as SamplingParams. `max_new_tokens` 0
    computes the prompt only (with `logprob_start_len`, for its logprobs)."""
    sp = sp or SGLangSampling()
    wanted, top_n = fields.return_logprob, fields.top_n
    # Absent: SGLang's 128 (capped by the context); null: the rest of the context.
    max_new_tokens = None if sp.max_new_tokens is msgspec.UNSET else sp.max_new_tokens
    return make_sampling(
        max_tokens=max_new_tokens,
        default_max_tokens=None if sp.max_new_tokens is None else DEFAULT_MAX_NEW_TOKENS,
        min_tokens=sp.min_new_tokens, seed=sp.sampling_seed, include_stop_str_in_output=sp.no_stop_trim,
        logprobs=top_n if wanted else None, prompt_logprobs=top_n if wanted and fields.start >= 0 else None,
        logprob_token_ids=list(fields.token_ids) if wanted else None,
        structured_output=from_sglang(sp.json_schema, sp.regex, sp.ebnf), **same_named(sp, SGLANG_SAMPLING),
    )


def token_ids_per_prompt(value: object, num_prompts: int, is_batch: bool, vocab_size: int) -> list[tuple[int, ...]]:
    """`token_ids_logprob`: one list of ids for every prompt, or (a batch) one list per prompt."""
    if value is None:
        return [()] * num_prompts
    if is_batch and isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        lists = per_prompt(value, num_prompts, "token_ids_logprob")
    else:
        lists = [value] * num_prompts
    return [tuple(check_token_ids(ids, vocab_size, "token_ids_logprob")) for ids in lists]


@dataclass(frozen=True)
class _Item:
    """One prompt of a /generate request, with its own sampling and logprob fields."""

    prompt: dict
    sampling: SamplingParams
    fields: LogprobFields

    def message(self, request_id: str, routing, priority: int) -> GenerateMsg:
        """The item's GenerateMsg; input logprobs need the prompt's ids back (text prompts too)."""
        f = self.fields
        return build_generate_msg(request_id, self.sampling, routing, **self.prompt, priority=priority,
                                  return_prompt=f.return_logprob and f.start >= 0,
                                  return_token_texts=f.return_logprob and f.return_text)


def _items(body: SGLangBody, vocab_size: int) -> tuple[list[_Item], bool]:
    prompts, is_batch = sglang_prompts(body, vocab_size)
    n = len(prompts)
    columns = zip(prompts, per_prompt(body.sampling_params, n, "sampling_params"),
                  per_prompt(body.return_logprob, n, "return_logprob"),
                  per_prompt(body.logprob_start_len, n, "logprob_start_len"),
                  per_prompt(body.top_logprobs_num, n, "top_logprobs_num"),
                  token_ids_per_prompt(body.token_ids_logprob, n, is_batch, vocab_size))
    items = []
    for prompt, sp, return_logprob, start, top_n, token_ids in columns:
        fields = LogprobFields(bool(return_logprob), -1 if start is None else start, top_n or 0, token_ids,
                               bool(body.return_text_in_logprobs))
        items.append(_Item(prompt, sglang_sampling(sp, fields), fields))
    return items, is_batch


def _request_ids(request: web.Request, rid: object, num_prompts: int, is_batch: bool) -> list[str]:
    """`rid`: a string for one prompt, a list of strings (one per prompt) for a batch."""
    if not is_batch:
        return [choose_request_id(request, rid, "rid", "cmpl")]
    if isinstance(rid, list):
        return [choose_request_id(request, r, "rid", "cmpl") for r in per_prompt(rid, num_prompts, "rid")]
    if rid is not None:
        raise BadRequest("rid of a batch must be a list of strings, one per prompt", "rid")
    base = choose_request_id(request, None, "rid", "cmpl")
    return [f"{base}-{i}" for i in range(num_prompts)]


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate: one prompt, or a batch answered as a list (streamed: events with `index`)."""
    state = state_of(request)
    raw = await read_body(request)
    body = decode_body(raw, SGLangBody)
    check_upstream(raw, SGLANG_REFUSED, SGLangBody, ("sampling_params", SGLANG_SAMPLING_REFUSED, SGLangSampling))
    items, is_batch = _items(body, state.engine.model.vocab_size)
    counts = [check_n(sp.n if sp is not None else None)
              for sp in per_prompt(body.sampling_params, len(items), "sampling_params")]
    request_ids = _request_ids(request, body.rid, len(items), is_batch)
    routing = read_routing(request, raw, state.warn_once)
    routings = routing.for_items(len(items))
    msgs = [item.message(rid, r, body.priority or 0) for rid, item, r in zip(request_ids, items, routings)]
    renderers = [SGLangRenderer(item.fields) for item in items]
    if not is_batch:
        return await serve_choices(request, msgs[0], routing.routed_dp_rank, lambda: SGLangRenderer(items[0].fields),
                                   n=counts[0], stream=bool(body.stream), merge=merge_sglang)
    if max(counts) > 1:
        raise BadRequest("n > 1 in a batch is not supported: send one prompt per request", "n")
    renderer = SGLangBatchRenderer(renderers)
    return await serve_batch(request, [(m, routing.routed_dp_rank) for m in msgs], renderer,
                             stream=bool(body.stream), request_id=request_ids[0])


def add_routes(app: web.Application) -> None:
    """Register POST /generate on `app`."""
    app.router.add_post("/generate", generate)
