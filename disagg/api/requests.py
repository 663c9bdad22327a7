"""From an HTTP body to a GenerateMsg: field checks, sampling, prompts, request ids.

Every check raises BadRequest (400) with `param` naming the field; sampling values are validated by
disagg.types.SamplingParams, so the front door rejects exactly what the engine would.
"""

from __future__ import annotations

import unicodedata
import uuid

import msgspec
from aiohttp import web

from disagg.api.bodies import SamplingFields, StreamOptions
from disagg.api.errors import ModelNotFound
from disagg.api.logging import bind_request
from disagg.api.routing import Routing
from disagg.api.structured import from_openai, from_sglang
from disagg.http_edge import BadRequest
from disagg.types import MAX_LOGPROBS, SAMPLING_FIELDS, SamplingParams
from disagg.wire.engine_msgs import GenerateMsg
from disagg.wire.headers import REQUEST_ID_HEADER

MAX_REQUEST_ID_CHARS = 256  # the id goes back in the X-Request-Id header; clients read headers up to 8 KiB


async def read_body(request: web.Request) -> bytes:
    """The raw body (aiohttp answers 413 past `max_body_bytes`); an empty body is a 400."""
    raw = await request.read()
    if not raw.strip():
        raise BadRequest("the request body is empty: send a JSON object")
    return raw


def check_model(model: str | None, served: str) -> None:
    """A request may name the served model or none; any other name is a 404 `model_not_found`."""
    if model is not None and model != served:
        raise ModelNotFound(model)


def check_stream_options(stream: bool | None, options: StreamOptions | None) -> None:
    """`stream_options` only makes sense with `stream: true`."""
    if options is not None and not stream:
        raise BadRequest("stream_options can only be set when stream is true", "stream_options")


def choose_request_id(request: web.Request, body_id: object, param: str, prefix: str) -> str:
    """The body's id (`request_id` / `rid`), else the `X-Request-Id` header, else `<prefix>-<uuid hex>`.

    The id is bound to the request's log lines from here on.
    """
    if body_id is not None:
        if not isinstance(body_id, str) or not body_id:
            raise BadRequest(f"{param} must be a non-empty string", param)
        if len(body_id) > MAX_REQUEST_ID_CHARS or any(unicodedata.category(c) == "Cc" for c in body_id):
            raise BadRequest(f"{param} must have at most {MAX_REQUEST_ID_CHARS} characters and no control "
                             "characters: it is sent back in the X-Request-Id header", param)
        request_id = body_id
    else:
        request_id = request.headers.get(REQUEST_ID_HEADER, "").strip() or f"{prefix}-{uuid.uuid4().hex}"
    bind_request(request_id)
    return request_id


def check_token_ids(value: object, vocab_size: int, param: str) -> list[int]:
    """A non-empty list of in-vocabulary token ids."""
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{param} must be a non-empty list of token ids", param)
    for token_id in value:
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise BadRequest(f"{param} must be a list of integer token ids", param)
        if token_id < 0:
            raise BadRequest(f"token id {token_id} in {param} is negative", param)
        if token_id >= vocab_size:
            raise BadRequest(f"token id {token_id} in {param} is out of vocabulary (vocab_size={vocab_size})", param)
    return value


def logprobs_count(value: int | None, param: str) -> int | None:
    """A logprobs count as vLLM takes it: -1 is as many as the server allows (MAX_LOGPROBS)."""
    if value is not None and value < -1:
        raise BadRequest(f"{param} must be -1 (as many as the server allows) or non-negative, got {value}", param)
    return MAX_LOGPROBS if value == -1 else value


def make_sampling(*, max_tokens: int | None, default_max_tokens: int | None, **fields: object) -> SamplingParams:
    """Validated SamplingParams; None means the default. `max_tokens` None means the client did not
    set it: the worker applies `default_max_tokens` (None: the rest of the context) once it knows the
    prompt's length."""
    return SamplingParams(max_tokens=max_tokens, default_max_tokens=default_max_tokens,
                          **{k: v for k, v in fields.items() if v is not None})


def same_named(body: msgspec.Struct, fields: frozenset[str]) -> dict[str, object]:
    """The body's fields named as SamplingParams names them: a new sampling field needs no copy here."""
    return {name: getattr(body, name) for name in fields}


# Fields whose name and meaning are SamplingParams' own in OpenAI's and vLLM's APIs.
OPENAI_SAMPLING = SAMPLING_FIELDS & frozenset(SamplingFields.__struct_fields__)


def sampling_from_fields(f: SamplingFields, *, max_tokens: int | None, default_max_tokens: int | None,
                         logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the fields OpenAI's and vLLM's APIs share."""
    structured = from_openai(f.response_format, f.structured_outputs,
                             {"json": f.guided_json, "regex": f.guided_regex, "choice": f.guided_choice,
                              "grammar": f.guided_grammar})
    sglang = from_sglang(*(getattr(f, name, None) for name in ("json_schema", "regex", "ebnf")))  # OpenAI bodies
    if sglang is not None and structured is not None:
        raise BadRequest(f"set {sglang.param} or response_format / structured_outputs, not both", sglang.param)
    structured = structured or sglang
    return make_sampling(max_tokens=max_tokens, default_max_tokens=default_max_tokens, logprobs=logprobs,
                         prompt_logprobs=prompt_logprobs, structured_output=structured,
                         **same_named(f, OPENAI_SAMPLING))


def build_generate_msg(request_id: str, sampling: SamplingParams, routing: Routing, **prompt: object) -> GenerateMsg:
    """The GenerateMsg: exactly one of prompt / prompt_token_ids / messages, plus the P/D fields
    (bootstrap lists of one entry, as a gateway may send for one prompt, are unwrapped)."""
    [routing] = routing.for_items(1)
    return GenerateMsg(
        request_id=request_id, sampling=sampling, **prompt,
        bootstrap_host=routing.bootstrap_host, bootstrap_port=routing.bootstrap_port,
        bootstrap_room=routing.bootstrap_room, disagg_prefill_dp_rank=routing.disagg_prefill_dp_rank,
        kv_transfer_params=routing.kv_transfer_params, disagg_prefill_here=routing.disagg_prefill_here,
    )
