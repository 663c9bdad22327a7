"""vLLM's POST /tokenize and POST /detokenize.

/tokenize takes vLLM's TokenizeCompletionRequest (`prompt`, `add_special_tokens` default true) or
TokenizeChatRequest (`messages`, `add_generation_prompt` default true, `continue_final_message`,
`add_special_tokens` default false) and answers `{count, max_model_len, tokens, token_strs}`
(`token_strs` null unless `return_token_strs`). /detokenize takes `{tokens}` and answers `{prompt}`.
One ready DP worker does the work (its tokenizer); the front never loads one.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from disagg.api.bodies import Int64, decode_body
from disagg.api.openai_routes import chat_messages
from disagg.api.requests import check_model, read_body
from disagg.api.serving import json_response
from disagg.api.state import STATE, state_of
from disagg.dp.protocol import EngineClient, WorkerUnavailable
from disagg.http_edge import BadRequest
from disagg.wire.engine_msgs import TokenizeMsg, TokenizeResultMsg, Utility


class TokenizeBody(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one struct (`messages` picks chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: object = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    """vLLM's DetokenizeRequest."""

    model: str | None = None
    tokens: list[Int64] | None = None


def tokenize_msg(body: TokenizeBody) -> TokenizeMsg:
    """The worker's arguments, with vLLM's defaults for the completion and the chat form."""
    strs = bool(body.return_token_strs)
    if body.messages is None:
        if body.prompt is None:
            raise BadRequest("send a prompt (a string) or messages", "prompt")
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return TokenizeMsg(prompt=body.prompt, add_special_tokens=special, return_token_strs=strs)
    cont = bool(body.continue_final_message)
    generation = not cont if body.add_generation_prompt is None else body.add_generation_prompt
    if cont and generation:
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                         "continue_final_message")
    return TokenizeMsg(messages=chat_messages(body.messages), add_special_tokens=bool(body.add_special_tokens),
                       add_generation_prompt=generation, continue_final_message=cont, return_token_strs=strs)


def ready_rank(engine: EngineClient) -> int:
    """The first DP worker that is alive and ready (any tokenizer will do: they are one model's)."""
    for state in engine.worker_states():
        if state.alive and state.ready:
            return state.dp_rank
    raise WorkerUnavailable("no DP worker is ready to tokenize")


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize."""
    engine = state_of(request).engine
    body = decode_body(await read_body(request), TokenizeBody)
    check_model(body.model, engine.model.name)
    msg = tokenize_msg(body)
    [raw] = await engine.call_utility(Utility.TOKENIZE, msg, ranks=[ready_rank(engine)])
    result = msgspec.convert(raw, TokenizeResultMsg)
    if result.error is not None:
        raise BadRequest(result.error, result.error_param)
    return json_response({"count": len(result.tokens), "max_model_len": engine.model.max_model_len,
                          "tokens": result.tokens, "token_strs": result.token_strs})


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize."""
    engine = state_of(request).engine
    body = decode_body(await read_body(request), DetokenizeBody)
    check_model(body.model, engine.model.name)
    if body.tokens is None:
        raise BadRequest("tokens is required: a list of token ids", "tokens")
    vocab_size = engine.model.vocab_size
    for token_id in body.tokens:
        if not 0 <= token_id < vocab_size:
            raise BadRequest(f"token id {token_id} in tokens is out of vocabulary (vocab_size={vocab_size})", "tokens")
    [text] = await engine.call_utility(Utility.DETOKENIZE, body.tokens, ranks=[ready_rank(engine)])
    return json_response({"prompt": text})


async def tokenizer_info(request: web.Request) -> web.Response:
    """GET /tokenizer_info (vLLM's, opt-in there too: --enable-tokenizer-info-endpoint): the
    tokenizer's class and settings, the chat template included."""
    engine = state_of(request).engine
    [info] = await engine.call_utility(Utility.TOKENIZER_INFO, ranks=[ready_rank(engine)])
    return json_response(info)


def add_routes(app: web.Application) -> None:
    """Register POST /tokenize and POST /detokenize on `app` (and GET /tokenizer_info when enabled)."""
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    if app[STATE].config.enable_tokenizer_info_endpoint:
        app.router.add_get("/tokenizer_info", tokenizer_info)
