"""Tokens-in/tokens-out POST /inference/v1/generate (vLLM's disaggregated-serving API).

Non-streaming: `{request_id, choices: [{index, token_ids, finish_reason, stop_reason, logprobs}],
prompt_logprobs, usage, dp_rank}`. Streaming (SSE): each event carries only the new token ids; the
finishing event always carries `finish_reason` (even with no new tokens); `usage` rides on every
event only with `include_usage` and `continuous_usage_stats`; `include_usage` adds a final
`choices: []` usage event; every stream ends with `data: [DONE]`.
"""

from __future__ import annotations

from aiohttp import web

from disagg.api.bodies import StreamOptions, TokensBody, TokensSampling, decode_body
from disagg.api.generation import Totals
from disagg.api.openai_render import chat_logprobs, ranked_prompt_logprobs
from disagg.api.requests import (
    build_generate_msg, check_model, check_stream_options, check_token_ids, choose_request_id, logprobs_count,
    read_body, sampling_from_fields,
)
from disagg.api.routing import read_routing
from disagg.api.parallel import check_n, merge_openai, serve_choices
from disagg.api.state import state_of
from disagg.api.upstream_fields import TOKENS_REFUSED, VLLM_SAMPLING_REFUSED, check_upstream
from disagg.http_edge import BadRequest
from disagg.types import SamplingParams
from disagg.wire.engine_msgs import OutputMsg

DEFAULT_MAX_TOKENS = None  # unset: the rest of the context, as current vLLM's tokens endpoint


def tokens_sampling(sp: TokensSampling) -> SamplingParams:
    """vLLM-style `sampling_params` as SamplingParams. As vLLM's tokens endpoint, `max_tokens` 0 is
    refused (it generates; scoring a prompt is the OpenAI endpoints' `max_tokens: 0`)."""
    if sp.max_tokens is not None and sp.max_tokens <= 0:
        raise BadRequest("max_tokens must be greater than 0.", "sampling_params")
    return sampling_from_fields(
        sp, max_tokens=sp.max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS,
        logprobs=logprobs_count(sp.logprobs, "logprobs"),
        prompt_logprobs=logprobs_count(sp.prompt_logprobs, "prompt_logprobs"),
    )


class TokensRenderer:
    """Bodies of /inference/v1/generate."""

    def __init__(self, include_usage: bool, continuous_usage: bool):
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        if not out.new_token_ids and out.finish_reason is None:
            return []
        choice = {"index": 0, "token_ids": list(out.new_token_ids), "finish_reason": out.finish_reason,
                  "stop_reason": out.stop_reason,
                  "logprobs": chat_logprobs(out.logprobs) if out.logprobs is not None else None}
        chunk = {"request_id": totals.request_id, "choices": [choice], "dp_rank": totals.dp_rank}
        if self.continuous_usage:
            chunk["usage"] = totals.usage()
        return [chunk]

    def tail(self, totals: Totals) -> list[object]:
        if not self.include_usage:
            return []
        return [{"request_id": totals.request_id, "choices": [], "usage": totals.usage(), "dp_rank": totals.dp_rank}]

    def full(self, totals: Totals) -> object:
        choice = {"index": 0, "token_ids": list(totals.token_ids), "finish_reason": totals.finish_reason,
                  "stop_reason": totals.stop_reason,
                  "logprobs": chat_logprobs(totals.logprobs) if totals.logprobs is not None else None}
        return {"request_id": totals.request_id, "choices": [choice],
                "prompt_logprobs": ranked_prompt_logprobs(totals, decoded=False),
                "usage": totals.usage(), "dp_rank": totals.dp_rank}


async def generate_tokens(request: web.Request) -> web.StreamResponse:
    """POST /inference/v1/generate."""
    state = state_of(request)
    raw = await read_body(request)
    body = decode_body(raw, TokensBody)
    check_upstream(raw, TOKENS_REFUSED, TokensBody, ("sampling_params", VLLM_SAMPLING_REFUSED, TokensSampling))
    check_model(body.model, state.engine.model.name)
    check_stream_options(body.stream, body.stream_options)
    token_ids = check_token_ids(body.token_ids, state.engine.model.vocab_size, "token_ids")
    sampling = tokens_sampling(body.sampling_params or TokensSampling())
    request_id = choose_request_id(request, body.request_id, "request_id", "cmpl")
    routing = read_routing(request, raw, state.warn_once)
    msg = build_generate_msg(request_id, sampling, routing, prompt_token_ids=token_ids, priority=body.priority or 0)
    options = body.stream_options or StreamOptions()
    n = check_n((body.sampling_params or TokensSampling()).n)
    return await serve_choices(
        request, msg, routing.routed_dp_rank,
        lambda: TokensRenderer(bool(options.include_usage), bool(options.continuous_usage_stats)),
        n=n, stream=bool(body.stream), merge=merge_openai)


def add_routes(app: web.Application) -> None:
    """Register POST /inference/v1/generate on `app`."""
    app.router.add_post("/inference/v1/generate", generate_tokens)
