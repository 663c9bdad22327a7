"""OpenAI-compatible routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models."""

from __future__ import annotations

from aiohttp import web

from disagg.api.bodies import ChatBody, CompletionBody, OpenAIBody, StreamOptions, decode_body
from disagg.api.errors import BadRequest
from disagg.api.openai_render import ChatRenderer, CompletionRenderer
from disagg.api.requests import (
    build_generate_msg,
    check_model,
    check_stream_options,
    check_token_ids,
    choose_request_id,
    read_body,
    sampling_from_fields,
)
from disagg.api.routing import read_routing
from disagg.api.serving import json_response, serve_generation
from disagg.api.state import ApiState, state_of

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default; chat defaults to the context length


def completion_prompt(prompt: object, vocab_size: int) -> dict:
    """`prompt` as a string, a list of one string, token ids, or a list of one token id list."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"batched prompts are not supported: got {len(prompt)} prompts, send one per request",
                         "prompt")
    if prompt is None:
        raise BadRequest("prompt is required", "prompt")
    return {"prompt_token_ids": check_token_ids(prompt, vocab_size, "prompt")}


def chat_messages(messages: object) -> list[dict]:
    """A non-empty list of `{role, content}` objects; the worker applies the chat template."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"messages[{i}].content must be a string or a list of content parts", "messages")
    return messages


def _common_checks(state: ApiState, body: OpenAIBody) -> StreamOptions:
    check_model(body.model, state.engine.model.name)
    check_stream_options(body.stream, body.stream_options)
    return body.stream_options or StreamOptions()


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    state = state_of(request)
    raw = await read_body(request)
    body = decode_body(raw, CompletionBody)
    options = _common_checks(state, body)
    if body.echo:
        raise BadRequest("echo is not supported", "echo")
    if body.best_of not in (None, 1):
        raise BadRequest(f"best_of must be 1, got {body.best_of}", "best_of")
    if body.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    prompt = completion_prompt(body.prompt, state.engine.model.vocab_size)
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    sampling = sampling_from_fields(body, max_tokens=max_tokens, logprobs=body.logprobs)
    request_id = choose_request_id(request, body.request_id, "request_id", "cmpl")
    routing = read_routing(request, raw, state.warn_once)
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    msg = build_generate_msg(request_id, sampling, routing, add_special_tokens=add_special, **prompt)
    renderer = CompletionRenderer(state.engine.model.name, bool(options.include_usage),
                                  bool(options.continuous_usage_stats))
    return await serve_generation(request, msg, routing.routed_dp_rank, renderer, stream=bool(body.stream))


def _chat_logprobs(body: ChatBody) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state = state_of(request)
    raw = await read_body(request)
    body = decode_body(raw, ChatBody)
    options = _common_checks(state, body)
    messages = chat_messages(body.messages)
    max_tokens = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None),
                      state.engine.model.max_model_len)
    sampling = sampling_from_fields(body, max_tokens=max_tokens, logprobs=_chat_logprobs(body))
    request_id = choose_request_id(request, body.request_id, "request_id", "chatcmpl")
    routing = read_routing(request, raw, state.warn_once)
    add_special = bool(body.add_special_tokens)  # the chat template already adds them
    msg = build_generate_msg(request_id, sampling, routing, messages=messages, add_special_tokens=add_special)
    renderer = ChatRenderer(state.engine.model.name, bool(options.include_usage),
                            bool(options.continuous_usage_stats))
    return await serve_generation(request, msg, routing.routed_dp_rank, renderer, stream=bool(body.stream))


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one served model."""
    state = state_of(request)
    card = state.engine.model
    return json_response({"object": "list", "data": [{
        "id": card.name, "object": "model", "created": state.started_at, "owned_by": "disagg",
        "root": card.name, "max_model_len": card.max_model_len,
    }]})


def add_routes(app: web.Application) -> None:
    """Register the OpenAI routes on `app`."""
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
