"""OpenAI's Responses API (`POST /v1/responses`, as vLLM serves it), on the chat machinery: the
request's `instructions`, the stored turns of `previous_response_id` and its `input` become chat
messages, `tools` and `tool_choice` the chat's (function tools), `text.format` the chat's
`response_format`, `max_output_tokens` its `max_tokens`; vLLM's extra sampling fields (`top_k`, `stop`,
`logit_bias`, `structured_outputs`, ...) go to the chat as they are, and the fields of vLLM's request
this server does not build are refused unless neutral (upstream_fields.py). The answer is a Response object (output
items: the assistant's message, or its function calls), streamed as Response events
(`response.created` ... `response.output_text.delta` ... `response.completed`).

`background: true` answers at once with the Response `queued` and runs on (api/responses_background.py).
Answers are kept (unless `store: false`) in a bounded store of this server (responses_store.py), by id, with the turns
that led to them, so a next request may name one as its `previous_response_id`. On P/D the decode
keeps them (a prefill's answer is one token); our router fetches the conversation from the decode
(`GET /v1/responses/{id}/conversation`) and sends it to both legs (`disagg_conversation`).
"""

from __future__ import annotations

import secrets

import msgspec
from aiohttp import web

from disagg.api.bodies import ChatBody, Int64, decode_body
from disagg.api.generation import Totals
from disagg.api.openai_routes import chat_generate_msg, note_unknown
from disagg.api.requests import check_model, choose_request_id, read_body
from disagg.api.responses_background import check_background, follow_events, start_in_background
from disagg.api.responses_store import STORE, ResponseStore
from disagg.api.routing import read_routing
from disagg.api.serving import json_response, serve_generation
from disagg.api.state import state_of
from disagg.api.tool_calls import whole_message
from disagg.api.upstream_fields import RESPONSES_IGNORED, RESPONSES_REFUSED, check_upstream
from disagg.config import DisaggregationMode
from disagg.http_edge import BadRequest, HttpError
from disagg.types import FinishReason
from disagg.wire.engine_msgs import OutputMsg



class ResponsesBody(msgspec.Struct, kw_only=True):
    """The fields of OpenAI's ResponseCreateParams this server honours."""

    model: str | None = None
    input: object = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool | None = None
    tools: list[dict] | None = None
    tool_choice: object = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    store: bool | None = None
    background: bool | None = None  # run on after the answer, polled (api/responses_background.py)
    metadata: dict | None = None
    user: str | None = None
    request_id: str | None = None
    # vLLM's extra sampling fields on this route, handed to the chat body as they are
    top_k: Int64 | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: object = None
    priority: Int64 | None = None
    chat_template_kwargs: dict[str, object] | None = None
    disagg_conversation: list[dict] | None = None  # our router's: the stored turns of previous_response_id (P/D)


PASSED_TO_CHAT = ("top_k", "repetition_penalty", "stop", "ignore_eos", "logit_bias", "skip_special_tokens",
                  "include_stop_str_in_output", "structured_outputs", "priority", "chat_template_kwargs")


def input_messages(value: object) -> list[dict]:
    """The `input` as chat messages: a string is the user's; items are messages (content a string or
    text parts), `function_call` items (the assistant's calls) and `function_call_output` items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("input must be a string or a non-empty list of items", "input")
    return [_item_message(item, i) for i, item in enumerate(value)]


def _item_message(item: object, i: int) -> dict:
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an object", "input")
    kind = item.get("type", "message")
    if kind == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": str(item.get("output", ""))}
    if kind != "message" or item.get("role") not in ("user", "assistant", "system", "developer"):
        raise BadRequest(f"{where}: an item is a message (role user, assistant, system or developer), a "
                         "function_call or a function_call_output", "input")
    content = item.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict)
                           and part.get("type") in ("input_text", "output_text", "text"))
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or a list of text parts", "input")
    return {"role": "system" if item["role"] == "developer" else item["role"], "content": content}


def chat_fields(body: ResponsesBody) -> dict:
    """The chat body's tools, tool choice and response format for the Responses body's."""
    out: dict = {}
    if body.tools:
        out["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                          if k in t}} for t in body.tools if t.get("type") == "function"]
        if len(out["tools"]) != len(body.tools):
            raise BadRequest("only function tools are supported", "tools")
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None:
        out["tool_choice"] = choice
    out.update({name: getattr(body, name) for name in PASSED_TO_CHAT if getattr(body, name) is not None})
    fmt = (body.text or {}).get("format")
    if body.structured_outputs is not None and isinstance(fmt, dict):
        raise BadRequest("Cannot specify both structured_outputs and text.format", "structured_outputs")  # vLLM's words
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                                         "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    return out


class ResponsesRenderer:
    """A Response object, whole or as its stream of events; the conversation is stored when it ends."""

    def __init__(self, model: str, response_id: str, body: ResponsesBody, messages: list[dict], tools, store):
        self.model, self.response_id, self.body, self.messages, self.tools = model, response_id, body, messages, tools
        self.store = store if body.store is not False else None  # None: nothing kept
        self.message_id = "msg_" + secrets.token_hex(12)
        self._seq, self._started = 0, False

    def event(self, kind: str, **fields) -> dict:
        """One Response stream event of `kind`, numbered."""
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def _streams_text(self) -> bool:
        return self.tools is None or self.tools.mode == "none"

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        events = []
        if not self._started:
            self._started = True
            snapshot = self.response(totals, "in_progress", [])
            events += [self.event("response.created", response=snapshot),
                       self.event("response.in_progress", response=snapshot)]
            if self._streams_text():
                events += [self.event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
                           self.event("response.content_part.added", item_id=self.message_id, output_index=0,
                                       content_index=0, part=_text_part(""))]
        if out.new_text and self._streams_text():
            events.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=0,
                                      content_index=0, delta=out.new_text, logprobs=[]))
        if out.finish_reason is not None:
            events += self._finish(totals)
        return events

    def _finish(self, totals: Totals) -> list[dict]:
        whole = self.full(totals)
        events = []
        if self._streams_text():
            events += [self.event("response.output_text.done", item_id=self.message_id, output_index=0,
                                   content_index=0, text=totals.text, logprobs=[]),
                       self.event("response.content_part.done", item_id=self.message_id, output_index=0,
                                   content_index=0, part=_text_part(totals.text)),
                       self.event("response.output_item.done", output_index=0, item=whole["output"][0])]
        else:
            for i, item in enumerate(whole["output"]):
                events += [self.event("response.output_item.added", output_index=i, item=item),
                           self.event("response.output_item.done", output_index=i, item=item)]
        return events + [self.event("response.completed", response=whole)]

    def tail(self, totals: Totals) -> list[object]:
        return []

    def full(self, totals: Totals) -> dict:
        content, calls = (totals.text, []) if self.tools is None else whole_message(self.tools, totals.text)
        output = [{"type": "function_call", "id": "fc_" + call["id"], "call_id": call["id"],
                   "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
                  for call in calls]
        if content or not calls:
            output.insert(0, self._message(content or "", "completed"))
        status = "incomplete" if totals.finish_reason == FinishReason.LENGTH else "completed"
        whole = {**self.response(totals, status, output), "usage": {
            "input_tokens": totals.num_prompt_tokens, "input_tokens_details": {"cached_tokens": totals.num_cached_tokens},
            "output_tokens": totals.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": totals.num_prompt_tokens + totals.num_output_tokens}}
        if self.store is not None:
            answer = {"role": "assistant", "content": content or "",
                      **({"tool_calls": calls} if calls else {})}
            self.store.put(self.response_id, [*self.messages, answer], whole)
        return whole

    def response(self, totals: Totals, status: str, output: list[dict]) -> dict:
        b = self.body
        return {"id": self.response_id, "object": "response", "created_at": totals.created, "model": self.model,
                "status": status, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "previous_response_id": b.previous_response_id,
                "max_output_tokens": b.max_output_tokens, "temperature": b.temperature, "top_p": b.top_p,
                "parallel_tool_calls": b.parallel_tool_calls is not False, "tool_choice": b.tool_choice or "auto",
                "tools": b.tools or [], "text": b.text or {"format": {"type": "text"}}, "metadata": b.metadata or {},
                "store": b.store is not False, "background": b.background is True, "dp_rank": totals.dp_rank}

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status,
                "content": [_text_part(text)] if text or status == "completed" else []}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    state = state_of(request)
    raw = await read_body(request)
    body = decode_body(raw, ResponsesBody)
    check_upstream(raw, RESPONSES_REFUSED, ResponsesBody)
    note_unknown(state, raw, ResponsesBody, RESPONSES_REFUSED, RESPONSES_IGNORED)
    check_model(body.model, state.engine.model.name)
    background = check_background(body.background, body.store)
    store = request.app[STORE]
    history: list[dict] = []
    if body.previous_response_id is not None and body.disagg_conversation is not None:
        history = body.disagg_conversation  # our router fetched it from the decode that stored it
    elif body.previous_response_id is not None:
        if state.engine.mode is DisaggregationMode.PREFILL:
            raise BadRequest("previous_response_id on a prefill server needs the conversation its decode stored: "
                             "send the request through our router, or the whole conversation as input",
                             "previous_response_id")
        history = store.get(body.previous_response_id)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages = [*system, *[m for m in history if not (system and m["role"] == "system")], *input_messages(body.input)]
    chat = msgspec.convert({"messages": messages, "max_tokens": body.max_output_tokens, "temperature": body.temperature,
                            "top_p": body.top_p, "seed": body.seed, "parallel_tool_calls": body.parallel_tool_calls,
                            **chat_fields(body)}, ChatBody)
    response_id = choose_request_id(request, body.request_id, "request_id", "resp")
    routing = read_routing(request, raw, state.warn_once)
    msg, tools = chat_generate_msg(state, chat, response_id, routing)
    keeps = state.engine.mode is not DisaggregationMode.PREFILL  # a prefill's answer is its one token: not a turn
    renderer = ResponsesRenderer(state.engine.model.name, response_id, body, messages, tools, store if keeps else None)
    if background and keeps:  # a prefill serves its leg as usual: the decode runs in the background
        return await start_in_background(request, msg, routing.routed_dp_rank, renderer, store, bool(body.stream))
    return await serve_generation(request, msg, routing.routed_dp_rank, renderer, stream=bool(body.stream))


async def conversation(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}/conversation (ours): the chat messages stored for an answer, its
    own last; our router reads them for a follow-up on P/D."""
    try:
        return json_response({"messages": request.app[STORE].get(request.match_info["response_id"])})
    except BadRequest as exc:
        raise HttpError(404, exc.message, code="response_not_found") from None


async def retrieve(request: web.Request) -> web.StreamResponse:
    """GET /v1/responses/{response_id} (the openai SDK's `responses.retrieve`): the stored Response; with
    `?stream=true` (and `starting_after`) a streamed background run's events, followed to its end."""
    response_id, store = request.match_info["response_id"], request.app[STORE]
    if request.query.get("stream", "false").lower() != "true":
        return json_response(store.response(response_id))
    return await follow_events(request, store.events(response_id), request.query.get("starting_after"))


async def cancel(request: web.Request) -> web.Response:
    """POST /v1/responses/{response_id}/cancel (the openai SDK's `responses.cancel`): stop a background run."""
    return json_response(await request.app[STORE].cancel(request.match_info["response_id"]))


async def delete(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{response_id}: forget a stored answer (a follow-up may no longer name it)."""
    response_id = request.match_info["response_id"]
    await request.app[STORE].delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    """Register POST /v1/responses, its retrieve and delete, our conversation route and the store on `app`."""
    app[STORE] = ResponseStore()
    app.on_cleanup.append(app[STORE].runs.close)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/conversation", conversation)
