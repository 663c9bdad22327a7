"""OpenAI-compatible routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models."""

from __future__ import annotations

import dataclasses

from aiohttp import web

from disagg.api.bodies import ChatBody, CompletionBody, OpenAIBody, RoutedBody, StreamOptions, decode_body
from disagg.api.errors import ModelNotFound
from disagg.api.batch import serve_batch
from disagg.api.openai_render import ChatRenderer, CompletionBatchRenderer, CompletionRenderer, VllmExtras
from disagg.api.requests import (
    build_generate_msg,
    check_model,
    check_stream_options,
    check_token_ids,
    choose_request_id,
    logprobs_count,
    read_body,
    sampling_from_fields,
)
from disagg.api.routing import read_routing
from disagg.api.beam_serving import beam_first_step, check_beam_request, serve_beam_search
from disagg.api.parallel import check_n, child_msgs, merge_openai, serve_choices
from disagg.api.serving import json_response
from disagg.api.state import ApiState, state_of
from disagg.api.tools import AUTO, ToolPlan, plan_tools, template_fields, tool_constraint
from disagg.api.upstream_fields import (
    CHAT_REFUSED, OPENAI_IGNORED, OPENAI_REFUSED, PD_FIELDS, check_upstream, unknown_fields,
)
from disagg.config import DisaggregationMode
from disagg.http_edge import BadRequest, invocation_path
from disagg.types import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy default, capped by the context; chat's is the rest of the context


def completion_prompt(prompt: object, vocab_size: int) -> dict:
    """One prompt: a string, a list of one string, token ids, or a list of one token id list."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", "prompt")
        return {"prompt": prompt}
    if prompt is None:
        raise BadRequest("prompt is required", "prompt")
    return {"prompt_token_ids": check_token_ids(prompt, vocab_size, "prompt")}


def completion_prompts(prompt: object, vocab_size: int) -> list[dict]:
    """Every prompt of a request: a list of strings or of token id lists is a batch (one choice each)."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return [completion_prompt(p, vocab_size) for p in prompt]
    return [completion_prompt(prompt, vocab_size)]


def chat_messages(messages: object) -> list[dict]:
    """`[{role, content}]` with every content a plain string, for the worker's chat template.

    Content may be a string, null (empty), or a list of content parts as the openai SDK, LangChain
    and LiteLLM send them; text parts (and bare strings) are joined with "\n", as vLLM does. Other
    part types (image_url, input_audio, ...) are refused: the model takes text only. `name`, an
    assistant's `tool_calls` and a tool answer's `tool_call_id` reach the template too (tools.py).
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'", "messages")
        out.append({"role": message["role"], "content": _content_text(message.get("content"), i),
                    **template_fields(message, i)})
    return out


def _content_text(content: object, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"messages[{i}].content must be a string or a list of content parts", "messages")
    texts = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadRequest(f"{where} must be an object with a string 'type'", where)
        if part["type"] != "text":
            raise BadRequest(f"{where}.type {part['type']!r} is not supported: this model takes text only "
                             "(content parts of type 'text')", f"{where}.type")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.text must be a string", f"{where}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def note_unknown(state: ApiState, raw: bytes, struct: type, refused, ignored: frozenset[str] = OPENAI_IGNORED) -> None:
    """Log, once per field and server, a field no API we follow has: it is ignored (vLLM's extra="allow")."""
    for name in unknown_fields(raw, struct, refused, ignored, PD_FIELDS, RoutedBody.__struct_fields__):
        state.warn_once(f"unknown field {name}", f"request field {name!r} is not known to this server and is "
                                                 "ignored, as vLLM ignores unknown fields")


def _common_checks(state: ApiState, body: OpenAIBody) -> StreamOptions:
    check_model(body.model, state.engine.model.name)
    check_stream_options(body.stream, body.stream_options)
    if body.stream and body.prompt_logprobs is not None and (body.prompt_logprobs > 0 or body.prompt_logprobs == -1):
        # vLLM's rule and words: a stream has no place for them (0 asks for none beyond the token's own: taken)
        raise BadRequest("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    return body.stream_options or StreamOptions()


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions: one prompt or a list (one choice per prompt, all submitted at once).
    `echo` returns the prompt before the completion (with `logprobs`: the prompt's too, computed
    by the engine); `max_tokens` 0 computes the prompt only (scoring)."""
    state = state_of(request)
    raw = await read_body(request)
    body = decode_body(raw, CompletionBody)
    check_upstream(raw, OPENAI_REFUSED, CompletionBody)
    note_unknown(state, raw, CompletionBody, OPENAI_REFUSED)
    options = _common_checks(state, body)
    check_length_penalty(body)
    if body.best_of not in (None, 1):
        raise BadRequest(f"best_of must be 1, got {body.best_of}", "best_of")
    if body.suffix:
        raise BadRequest("suffix is not supported", "suffix")
    prompts = completion_prompts(body.prompt, state.engine.model.vocab_size)
    echo = bool(body.echo)
    asked = logprobs_count(body.prompt_logprobs, "prompt_logprobs")
    sampling = sampling_from_fields(body, max_tokens=body.max_tokens, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
                                    logprobs=body.logprobs, prompt_logprobs=asked if asked is not None
                                    else body.logprobs if echo else None)
    extras = vllm_extras(body)
    request_id = choose_request_id(request, body.request_id, "request_id", "cmpl")
    routing = read_routing(request, raw, state.warn_once)
    add_special = True if body.add_special_tokens is None else body.add_special_tokens
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    msgs = [build_generate_msg(rid, sampling, r, add_special_tokens=add_special,
                               return_prompt=echo or extras.prompt_logprobs or extras.token_ids,
                               return_token_texts=wants_token_texts(body, sampling), priority=body.priority or 0,
                               **prompt)
            for rid, prompt, r in zip(ids, prompts, routing.for_items(len(prompts)))]

    def renderer(i: int, prompt: dict) -> CompletionRenderer:
        return CompletionRenderer(state.engine.model.name, bool(options.include_usage),
                                  bool(options.continuous_usage_stats), echo=echo, prompt_text=prompt.get("prompt"),
                                  index=i, response_id=request_id, extras=extras)

    n = check_n(body.n)
    if body.use_beam_search:
        if echo:
            raise BadRequest("echo does not apply to beam search", "echo")
        width = check_beam_request(sampling, body.n)
        if state.engine.mode is not DisaggregationMode.PREFILL:
            return await serve_beam_search(request, msgs, routing.routed_dp_rank, lambda i: renderer(i, prompts[i]),
                                           request_id=request_id, width=width, stream=bool(body.stream),
                                           length_penalty=1.0 if body.length_penalty is None else body.length_penalty)
        msgs, n = [beam_first_step(m, width) for m in msgs], 1  # a prefill computes the search's first step
    return await _serve_prompts(request, msgs, routing, lambda i: renderer(i, prompts[i // n]), n=n,
                                stream=bool(body.stream), request_id=request_id)


async def _serve_prompts(request: web.Request, msgs: list, routing, renderer, *, n: int, stream: bool,
                         request_id: str) -> web.StreamResponse:
    """One prompt's `n` choices, or a list's: choice `p * n + i` is prompt p's i-th (vLLM's order);
    `renderer(i)` shapes choice i."""
    if len(msgs) == 1:
        return await serve_choices(request, msgs[0], routing.routed_dp_rank, lambda: renderer(0), n=n, stream=stream,
                                   merge=merge_openai)
    if n > 1 and isinstance(routing.kv_transfer_params, dict):
        raise BadRequest("n > 1 is not supported in the pull flow (kv_transfer_params): each choice needs its own "
                         "ticket; send n requests, or use the push flow or a unified server", "n")
    children = [child for m in msgs for child in child_msgs(m, n)] if n > 1 else msgs
    return await serve_batch(request, [(m, routing.routed_dp_rank) for m in children],
                             CompletionBatchRenderer([renderer(i) for i in range(len(children))], n),
                             stream=stream, request_id=request_id)


def check_length_penalty(body: OpenAIBody) -> None:
    """`length_penalty` scores beams: without `use_beam_search` it would change nothing."""
    if not body.use_beam_search and body.length_penalty not in (None, 1.0):
        raise BadRequest("length_penalty applies only with use_beam_search", "length_penalty")


def vllm_extras(body: OpenAIBody) -> VllmExtras:
    """The vLLM answer fields `body` asks for."""
    return VllmExtras(prompt_logprobs=body.prompt_logprobs is not None, token_ids=bool(body.return_token_ids))


def wants_token_texts(body: OpenAIBody, sampling: SamplingParams) -> bool:
    """Logprobs name tokens by their text, unless `return_tokens_as_token_ids` (then `token_id:<id>`)."""
    asked = sampling.logprobs is not None or sampling.prompt_logprobs is not None
    return asked and not body.return_tokens_as_token_ids


def _chat_logprobs(body: ChatBody) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise BadRequest("top_logprobs requires logprobs to be true", "top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def _chat_sampling(state: ApiState, body: ChatBody) -> tuple[SamplingParams, ToolPlan | None]:
    """The chat's sampling and its tool plan: a `required` or named choice is generated under its
    schema; the hermes parser needs the special tokens kept in the text, as vLLM's does."""
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    sampling = sampling_from_fields(body, max_tokens=max_tokens, default_max_tokens=None,  # unset: the rest of the context
                                    logprobs=_chat_logprobs(body),
                                    prompt_logprobs=logprobs_count(body.prompt_logprobs, "prompt_logprobs"))
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, state.config.tools)
    if plan is None:
        return sampling, None
    constraint = tool_constraint(plan)
    if constraint is not None and sampling.structured_output is not None:
        raise BadRequest(f"tool_choice {plan.mode!r} writes its own JSON schema: leave response_format and "
                         "structured_outputs unset", "tool_choice")
    if constraint is not None:
        sampling = dataclasses.replace(sampling, structured_output=constraint)
    if plan.mode == AUTO:
        sampling = dataclasses.replace(sampling, skip_special_tokens=False)
    return sampling, plan


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state = state_of(request)
    raw = await read_body(request)
    body = decode_body(raw, ChatBody)
    check_upstream(raw, CHAT_REFUSED, ChatBody)
    note_unknown(state, raw, ChatBody, CHAT_REFUSED)
    options = _common_checks(state, body)
    extras = vllm_extras(body)
    request_id = choose_request_id(request, body.request_id, "request_id", "chatcmpl")
    routing = read_routing(request, raw, state.warn_once)
    check_length_penalty(body)
    msg, tools = chat_generate_msg(state, body, request_id, routing)
    n = check_n(body.n)
    if body.use_beam_search:
        if tools is not None:
            raise BadRequest("tools do not apply to beam search", "tools")
        width = check_beam_request(msg.sampling, body.n)
        if state.engine.mode is not DisaggregationMode.PREFILL:
            return await serve_beam_search(
                request, [msg], routing.routed_dp_rank, lambda _: ChatRenderer(
                    state.engine.model.name, bool(options.include_usage), bool(options.continuous_usage_stats),
                    None, extras), request_id=request_id, width=width, stream=bool(body.stream),
                length_penalty=1.0 if body.length_penalty is None else body.length_penalty)
        msg, n = beam_first_step(msg, width), 1  # a prefill computes the search's first step
    return await serve_choices(
        request, msg, routing.routed_dp_rank, lambda: ChatRenderer(
            state.engine.model.name, bool(options.include_usage), bool(options.continuous_usage_stats), tools, extras),
        n=n, stream=bool(body.stream), merge=merge_openai)


def chat_generate_msg(state: ApiState, body: ChatBody, request_id: str, routing) -> tuple:
    """The GenerateMsg of a chat body (its messages, sampling, tool plan, template switches) and the
    tool plan; shared by /v1/chat/completions and /v1/responses."""
    messages = chat_messages(body.messages)
    sampling, tools = _chat_sampling(state, body)
    extras = vllm_extras(body)
    add_special = bool(body.add_special_tokens)  # the chat template already adds them
    cont = bool(body.continue_final_message)
    generation = not cont if body.add_generation_prompt is None else body.add_generation_prompt
    if cont and generation:
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                         "continue_final_message")
    template_kwargs = {**({"tools": tools.template_tools} if tools and tools.template_tools else {}),
                       **(body.chat_template_kwargs or {})}
    msg = build_generate_msg(request_id, sampling, routing, messages=messages, add_special_tokens=add_special,
                             chat_template_kwargs=template_kwargs or None,
                             add_generation_prompt=generation, continue_final_message=cont,
                             return_token_texts=wants_token_texts(body, sampling), priority=body.priority or 0,
                             return_prompt=extras.prompt_logprobs or extras.token_ids)
    return msg, tools


def _model_object(state) -> dict:
    card = state.engine.model
    return {"id": card.name, "object": "model", "created": state.started_at, "owned_by": "disagg", "root": card.name,
            "max_model_len": card.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the one served model."""
    return json_response({"object": "list", "data": [_model_object(state_of(request))]})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{model_id} (the openai SDK's `models.retrieve`): the served model, else 404."""
    state = state_of(request)
    model_id = request.match_info["model_id"]
    if model_id != state.engine.model.name:
        raise ModelNotFound(model_id)
    return json_response(_model_object(state))


async def invocations(request: web.Request) -> web.StreamResponse:
    """POST /invocations (SageMaker's route, as vLLM serves it): a chat body (it has `messages`) is a
    chat completion, a completions body (`prompt`) a completion; anything else is a 400."""
    path = invocation_path(await read_body(request))
    return await (chat_completions(request) if path == "/v1/chat/completions" else completions(request))


def add_routes(app: web.Application) -> None:
    """Register the OpenAI routes on `app`."""
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/invocations", invocations)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", retrieve_model)
