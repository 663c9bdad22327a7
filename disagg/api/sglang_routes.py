"""SGLang-native POST /generate: `text` or `input_ids`, `sampling_params`, `meta_info` answers.

Streaming follows SGLang: every `data:` event holds the cumulative `text` and `output_ids` so far,
then `data: [DONE]`.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from disagg.api.batch import serve_batch
from disagg.api.bodies import SGLangBody, SGLangSampling, decode_body
from disagg.api.errors import BadRequest
from disagg.api.generation import TokenLogprobs, Totals
from disagg.api.requests import (
    build_generate_msg,
    check_token_ids,
    check_unsupported,
    choose_request_id,
    make_sampling,
    read_body,
)
from disagg.api.routing import read_routing
from disagg.api.serving import serve_generation
from disagg.api.state import state_of
from disagg.wire.engine_msgs import OutputMsg, SamplingMsg

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default (capped by the context, never refused)


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


def sglang_sampling(sp: SGLangSampling | None, return_logprob: bool, start: int, top_n: int) -> SamplingMsg:
    """SGLang's `sampling_params` (+ the logprob fields) as a SamplingMsg. `max_new_tokens` 0
    computes the prompt only (with `logprob_start_len`, for its logprobs)."""
    sp = sp or SGLangSampling()
    check_unsupported(sp.n, sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
    return make_sampling(
        max_tokens=sp.max_new_tokens, default_max_tokens=DEFAULT_MAX_NEW_TOKENS,
        min_tokens=sp.min_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        min_p=sp.min_p, seed=sp.sampling_seed, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
        include_stop_str_in_output=sp.no_stop_trim,
        logprobs=top_n if return_logprob else None, prompt_logprobs=top_n if return_logprob and start >= 0 else None,
    )


def finish_reason_info(totals: Totals) -> dict | None:
    """SGLang's `meta_info.finish_reason`: `{"type": "stop", "matched": ...}`, length or abort."""
    reason = totals.finish_reason
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop"} if totals.stop_reason is None else {"type": "stop", "matched": totals.stop_reason}
    if reason == "length":
        return {"type": "length", "length": totals.num_output_tokens}
    return {"type": reason, "message": "the request was aborted"} if reason == "abort" else {"type": reason}


def _triples(entries: list[tuple[int, float]]) -> list[list]:
    return [[lp, token_id, None] for token_id, lp in entries]


class SGLangRenderer:
    """Bodies of /generate: `{text, output_ids, meta_info}`, cumulative in every streamed event."""

    def __init__(self, return_logprob: bool, logprob_start_len: int, top_logprobs_num: int,
                 prompt_token_ids: list[int] | None):
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.prompt_token_ids = prompt_token_ids

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        if not out.new_token_ids and out.finish_reason is None:
            return []
        return [self.full(totals)]

    def tail(self, totals: Totals) -> list[object]:
        return []

    def full(self, totals: Totals) -> object:
        meta = {
            "id": totals.request_id, "finish_reason": finish_reason_info(totals),
            "prompt_tokens": totals.num_prompt_tokens, "completion_tokens": totals.num_output_tokens,
            "cached_tokens": totals.num_cached_tokens, "dp_rank": totals.dp_rank,
            "e2e_latency": totals.e2e_latency_s,
        }
        if self.return_logprob:
            meta.update(self._logprobs(totals))
        return {"text": totals.text, "output_ids": list(totals.token_ids), "meta_info": meta}

    def _logprobs(self, totals: Totals) -> dict:
        outputs: list[TokenLogprobs] = totals.logprobs or []
        found = {"output_token_logprobs": [_triples(e[:1])[0] for e in outputs]}
        if self.top_logprobs_num:
            found["output_top_logprobs"] = [_triples(e[1:]) for e in outputs]
        if self.logprob_start_len >= 0:
            found.update(self._input_logprobs(totals.prompt_logprobs or []))
        return found

    def _input_logprobs(self, prompt: list[TokenLogprobs | None]) -> dict:
        ids = self.prompt_token_ids or []
        tokens, tops = [], []
        for i, entry in enumerate(prompt[self.logprob_start_len:], start=self.logprob_start_len):
            known_id = ids[i] if i < len(ids) else None
            tokens.append([None, known_id, None] if entry is None else _triples(entry[:1])[0])
            tops.append(None if entry is None else _triples(entry[1:]))
        found = {"input_token_logprobs": tokens}
        if self.top_logprobs_num:
            found["input_top_logprobs"] = tops
        return found


@dataclass(frozen=True)
class _Item:
    """One prompt of a /generate request, with its own sampling and logprob fields."""

    prompt: dict
    sampling: SamplingMsg
    renderer: SGLangRenderer


def _items(body: SGLangBody, vocab_size: int) -> tuple[list[_Item], bool]:
    prompts, is_batch = sglang_prompts(body, vocab_size)
    n = len(prompts)
    columns = zip(prompts, per_prompt(body.sampling_params, n, "sampling_params"),
                  per_prompt(body.return_logprob, n, "return_logprob"),
                  per_prompt(body.logprob_start_len, n, "logprob_start_len"),
                  per_prompt(body.top_logprobs_num, n, "top_logprobs_num"))
    items = []
    for prompt, sp, return_logprob, start, top_n in columns:
        start = -1 if start is None else start
        sampling = sglang_sampling(sp, bool(return_logprob), start, top_n or 0)
        renderer = SGLangRenderer(bool(return_logprob), start, top_n or 0, prompt.get("prompt_token_ids"))
        items.append(_Item(prompt, sampling, renderer))
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
    items, is_batch = _items(body, state.engine.model.vocab_size)
    request_ids = _request_ids(request, body.rid, len(items), is_batch)
    routing = read_routing(request, raw, state.warn_once)
    routings = routing.for_items(len(items))
    msgs = [build_generate_msg(rid, item.sampling, r, **item.prompt) for rid, item, r in zip(request_ids, items, routings)]
    if not is_batch:
        return await serve_generation(request, msgs[0], routing.routed_dp_rank, items[0].renderer,
                                      stream=bool(body.stream))
    renderer = SGLangBatchRenderer([item.renderer for item in items])
    return await serve_batch(request, [(m, routing.routed_dp_rank) for m in msgs], renderer,
                             stream=bool(body.stream), request_id=request_ids[0])


class SGLangBatchRenderer:
    """A batch's bodies: the list of every item's answer; streamed, each event is one item's
    cumulative answer with its `index` (as SGLang streams batches)."""

    def __init__(self, renderers: list[SGLangRenderer]):
        self.renderers = renderers

    def chunks(self, index: int, out: OutputMsg, totals: Totals) -> list[object]:
        return [{**chunk, "index": index} for chunk in self.renderers[index].chunks(out, totals)]

    def tail(self, totals: list[Totals]) -> list[object]:
        return []

    def full(self, totals: list[Totals]) -> object:
        return [r.full(t) for r, t in zip(self.renderers, totals)]


def add_routes(app: web.Application) -> None:
    """Register POST /generate on `app`."""
    app.router.add_post("/generate", generate)
