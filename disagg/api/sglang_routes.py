"""SGLang-native POST /generate: `text` or `input_ids`, `sampling_params`, `meta_info` answers.

Streaming follows SGLang: every `data:` event holds the cumulative `text` and `output_ids` so far,
then `data: [DONE]`.
"""

from __future__ import annotations

from aiohttp import web

from disagg.api.bodies import SGLangBody, SGLangSampling, decode_body
from disagg.api.errors import BadRequest
from disagg.api.generation import TokenLogprobs, Totals
from disagg.api.requests import (
    build_generate_msg,
    check_token_ids,
    choose_request_id,
    make_sampling,
    read_body,
)
from disagg.api.routing import read_routing
from disagg.api.parallel import check_n, merge_sglang, serve_choices
from disagg.api.state import state_of
from disagg.api.structured import from_sglang
from disagg.api.upstream_fields import SGLANG_REFUSED, SGLANG_SAMPLING_REFUSED, check_upstream
from disagg.wire.engine_msgs import OutputMsg, SamplingMsg

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default (capped by the context, never refused)


def sglang_prompt(body: SGLangBody, vocab_size: int) -> dict:
    """Exactly one of `text` (a string) and `input_ids` (a list of token ids)."""
    if (body.text is None) == (body.input_ids is None):
        raise BadRequest("send exactly one of text and input_ids", "text")
    if body.text is not None:
        if not isinstance(body.text, str) or not body.text:
            raise BadRequest("text must be a non-empty string (batched requests are not supported)", "text")
        return {"prompt": body.text}
    return {"prompt_token_ids": check_token_ids(body.input_ids, vocab_size, "input_ids")}


def sglang_sampling(body: SGLangBody) -> SamplingMsg:
    """SGLang's `sampling_params` (+ the logprob fields) as a SamplingMsg."""
    sp = body.sampling_params or SGLangSampling()
    top_n = body.top_logprobs_num or 0
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    wants_prompt = bool(body.return_logprob) and start >= 0
    return make_sampling(
        max_tokens=sp.max_new_tokens, default_max_tokens=DEFAULT_MAX_NEW_TOKENS,
        min_tokens=sp.min_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        min_p=sp.min_p, seed=sp.sampling_seed, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos, skip_special_tokens=sp.skip_special_tokens,
        include_stop_str_in_output=sp.no_stop_trim,
        logprobs=top_n if body.return_logprob else None, prompt_logprobs=top_n if wants_prompt else None,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, logit_bias=sp.logit_bias,
        structured_output=from_sglang(sp.json_schema, sp.regex, sp.ebnf),
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


async def generate(request: web.Request) -> web.StreamResponse:
    """POST /generate."""
    state = state_of(request)
    raw = await read_body(request)
    body = decode_body(raw, SGLangBody)
    check_upstream(raw, SGLANG_REFUSED, SGLangBody, ("sampling_params", SGLANG_SAMPLING_REFUSED, SGLangSampling))
    prompt = sglang_prompt(body, state.engine.model.vocab_size)
    sampling = sglang_sampling(body)
    request_id = choose_request_id(request, body.rid, "rid", "cmpl")
    routing = read_routing(request, raw, state.warn_once)
    msg = build_generate_msg(request_id, sampling, routing, **prompt)
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    n = check_n((body.sampling_params or SGLangSampling()).n)
    return await serve_choices(
        request, msg, routing.routed_dp_rank, lambda: SGLangRenderer(
            bool(body.return_logprob), start, body.top_logprobs_num or 0, prompt.get("prompt_token_ids")),
        n=n, stream=bool(body.stream), merge=merge_sglang)


def add_routes(app: web.Application) -> None:
    """Register POST /generate on `app`."""
    app.router.add_post("/generate", generate)
