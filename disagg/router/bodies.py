"""Pure edits of request and response bodies: the internal fields dropped from a client's body, the
P/D fields the router adds, the DP ranks of the external-DP-routing test mode, prompt-logprob
merging and the decode's reported DP rank.

Bodies are plain JSON values (dicts and lists); inputs are never modified in place, except by
`merge_prompt_logprobs`, which documents it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from disagg.http_edge import JSON_TOO_DEEP, BadRequest, decode_json
from disagg.router.errors import DpRankMismatch

GENERATE_PATH = "/generate"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
TOKENS_PATH = "/inference/v1/generate"
NOT_JSON = "request body is not valid JSON"  # the words before why a body is refused
# Prompt-logprob fields of SGLang's /generate meta_info; only the prefill computes them.
PROMPT_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")
# Fields only the router sets: a client's copy could send the KV elsewhere or leave a leg waiting.
PD_FIELDS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "disagg_prefill_here")
# DP routing fields (and the deprecated alias): the client's unless the router trusts them.
ROUTING_FIELDS = ("routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank")


def parse_request_body(raw: bytes) -> dict:
    """The client's body as a dict; BadRequest unless it is a JSON object."""
    body = decode_json(raw, malformed=NOT_JSON)
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def without_internal_fields(body: dict, trust_routing: bool) -> dict:
    """A copy of the client's body without the fields the router owns: the P/D fields always, the
    DP routing fields unless `trust_routing` (`--trust-client-routing`)."""
    dropped = PD_FIELDS if trust_routing else PD_FIELDS + ROUTING_FIELDS
    return {name: value for name, value in body.items() if name not in dropped}


def is_stream(body: dict) -> bool:
    """`"stream": true` asks for server-sent events."""
    return body.get("stream") is True


def generate_batch_size(path: str, body: dict) -> int | None:
    """The number of prompts of a batched request (SGLang /generate with `text` or `input_ids`
    lists, /v1/completions with a list of prompts); None for a single prompt. Each prompt of a
    batch is its own P/D transfer: it gets its own room."""
    if path == COMPLETIONS_PATH:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            return len(prompt)
        return None
    if path != GENERATE_PATH:
        return None
    text = body.get("text")
    if isinstance(text, list):
        if not text:
            raise BadRequest("text is an empty list: send a prompt (or a non-empty batch of prompts)", "text")
        return len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def routing_text(path: str, body: dict) -> str | tuple[int, ...]:
    """What `--policy cache_aware` matches (sglang-router's text for routing): the completion's
    `prompt`, the chat messages' text contents joined by a space, /generate's `text` or
    `input_ids`, the tokens route's `token_ids`. Token ids come back as a tuple; a batch of
    prompts is joined (strings by a space, id lists end to end); anything else is ""."""
    if path == COMPLETIONS_PATH:
        return _prompt_symbols(body.get("prompt"))
    if path == CHAT_PATH:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        texts = [_content_text(m.get("content")) for m in messages if isinstance(m, dict)]
        return " ".join(t for t in texts if t)
    if path == GENERATE_PATH:
        return _prompt_symbols(body.get("text")) or _prompt_symbols(body.get("input_ids"))
    if path == TOKENS_PATH:
        return _prompt_symbols(body.get("token_ids"))
    return ""


def tokenize_body(path: str, body: dict) -> dict | None:
    """The `/tokenize` body that gives a generate body's prompt as the worker tokenizes it (vLLM's
    TokenizeCompletionRequest or TokenizeChatRequest); None for batches and prompts it cannot express."""
    if path == CHAT_PATH and isinstance(body.get("messages"), list):
        out = {"messages": body["messages"]}
        for key in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
            if key in body:
                out[key] = body[key]
        return None if "chat_template_kwargs" in body or "chat_template" in body else out
    prompt = body.get("prompt") if path == COMPLETIONS_PATH else body.get("text") if path == GENERATE_PATH else None
    return {"prompt": prompt} if isinstance(prompt, str) else None


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _prompt_symbols(value: object) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        return ""
    if all(isinstance(v, str) for v in value):
        return " ".join(value)
    if _is_ids(value):
        return tuple(value)
    if all(_is_ids(v) for v in value):
        return tuple(i for ids in value for i in ids)
    return ""


def _content_text(content: object) -> str:
    """A message's text: the string, or its `text` parts joined by a space."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


@dataclass(frozen=True)
class Bootstrap:
    """The P/D fields of one request: where the prefill's registry is, and the room (or rooms)."""

    host: str
    port: int | None
    room: int | list[int]

    def fields(self) -> dict:
        """`bootstrap_host/port/room`, as lists of equal length for a batch (SGLang's form)."""
        if isinstance(self.room, list):
            count = len(self.room)
            return {"bootstrap_host": [self.host] * count, "bootstrap_port": [self.port] * count,
                    "bootstrap_room": list(self.room)}
        return {"bootstrap_host": self.host, "bootstrap_port": self.port, "bootstrap_room": self.room}


def encode_body(body: dict) -> bytes:
    """A leg's body as JSON. A body nested just short of the decoder's limit can still exhaust the
    (deeper) stack here: that is the client's 400, never our 500."""
    try:
        return msgspec.json.encode(body)
    except RecursionError:
        raise BadRequest(f"{NOT_JSON}: {JSON_TOO_DEEP}") from None


def with_bootstrap(body: dict, bootstrap: Bootstrap) -> dict:
    """A copy of `body` carrying the P/D fields (the router's values replace any the client sent)."""
    return {**body, **bootstrap.fields()}


def with_dp_ranks(body: dict, prefill_rank: int, decode_rank: int | None) -> tuple[dict, dict]:
    """(prefill body, decode body) with the prefill's DP rank pinned (the external-DP-routing test
    mode, `--policy cache_aware`).

    The prefill leg gets `routed_dp_rank`, the decode leg its own (unless `decode_rank` is None: the
    decode picks); the decode leg also learns which prefill DP worker holds the KV
    (`disagg_prefill_dp_rank`), so it never asks the registry. The prefill leg carries it too: it
    tells the prefill that its decode knows the rank, so a rank other than room % dp_size is no
    conflict under follow_bootstrap_room.
    """
    prefill = {**body, "routed_dp_rank": prefill_rank, "disagg_prefill_dp_rank": prefill_rank}
    decode = {**body, "disagg_prefill_dp_rank": prefill_rank}
    if decode_rank is not None:
        decode["routed_dp_rank"] = decode_rank
    return prefill, decode


def wants_prompt_logprobs(path: str, body: dict) -> bool:
    """A /generate request with `return_logprob`: the prompt logprobs come from the prefill."""
    flag = body.get("return_logprob")
    return path == GENERATE_PATH and (any(flag) if isinstance(flag, list) else bool(flag))


def merge_prompt_logprobs(decode_json: object, prefill_json: object) -> bool:
    """Copy the prefill's prompt logprobs into the decode's `meta_info` where the decode lacks them.

    Works item by item on batched answers. Modifies `decode_json` in place; True if anything changed.
    """
    if isinstance(decode_json, list) and isinstance(prefill_json, list):
        changed = [merge_prompt_logprobs(d, p) for d, p in zip(decode_json, prefill_json)]
        return any(changed)
    if not isinstance(decode_json, dict) or not isinstance(prefill_json, dict):
        return False
    decode_meta, prefill_meta = decode_json.get("meta_info"), prefill_json.get("meta_info")
    if not isinstance(decode_meta, dict) or not isinstance(prefill_meta, dict):
        return False
    changed = False
    for key in PROMPT_LOGPROB_KEYS:
        if not decode_meta.get(key) and prefill_meta.get(key) is not None:
            decode_meta[key] = prefill_meta[key]
            changed = True
    return changed


def reported_dp_ranks(decode_json: object, header: str | None) -> list[object]:
    """The DP rank(s) the decode says served the request, one per answer item.

    Order of precedence per item: top-level `dp_rank` (OpenAI and tokens answers), then
    `meta_info.dp_rank` (/generate), then the `X-data-parallel-rank` response header; None if absent.
    """
    items = decode_json if isinstance(decode_json, list) else [decode_json]
    from_header = _header_rank(header)
    return [_item_rank(item, from_header) for item in items] or [from_header]


def _item_rank(item: object, from_header: object) -> object:
    if isinstance(item, dict):
        if item.get("dp_rank") is not None:
            return item["dp_rank"]
        meta = item.get("meta_info")
        if isinstance(meta, dict) and meta.get("dp_rank") is not None:
            return meta["dp_rank"]
    return from_header


def _header_rank(header: str | None) -> object:
    if header is None:
        return None
    try:
        return int(header.strip())
    except ValueError:
        return header


def check_decode_dp_rank(sent: int, decode_json: object, header: str | None) -> None:
    """DpRankMismatch unless every answer item reports the rank the decode leg was sent."""
    for reported in reported_dp_ranks(decode_json, header):
        if reported != sent or isinstance(reported, bool):
            raise DpRankMismatch(sent, reported)
