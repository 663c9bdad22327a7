"""Seeded mutations of valid request bodies, and the checks every answer to one must pass.

Bodies come out as raw bytes: some mutations (NaN, 1e999, nesting 100,000 deep, invalid UTF-8,
truncation) cannot be written by json.dumps. Every field a route knows is a target (the names come
from the route's msgspec struct), plus unknown fields, deleted fields and whole-body replacements.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field

import msgspec

from disagg.api.bodies import (
    ChatBody, CompletionBody, RoutedBody, SGLangBody, SGLangSampling, StreamOptions, TokensBody, TokensSampling,
)
from disagg.api.utility_routes import SleepBody

GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
ERROR_KEYS = {"message", "type", "param", "code"}
SERVER_ERROR_TYPES = {"InternalServerError", "ServiceUnavailableError", "BadGatewayError", "GatewayTimeoutError",
                      "InconsistentUtilityResults", "UtilityFailed"}


class Raw(bytes):
    """A JSON value written as these bytes, as they are."""


def deep(n: int, open_: bytes = b"[", close: bytes = b"]") -> Raw:
    return Raw(open_ * n + close * n)


RAW_VALUES = [
    Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"), Raw(b"1e999"), Raw(b"-1e999"), Raw(b"1E400"), Raw(b"-0"),
    Raw(b"123456789012345678901234567890123456789012345678901234567890"), Raw(b'"\\ud800"'), Raw(b'"\xff\xfe"'),
    deep(50), deep(900), deep(1000), deep(5000), deep(100_000), Raw(b'{"a":' * 3000 + b"1" + b"}" * 3000),
]
SCALARS = [
    None, True, False, 0, 1, -1, 2, 3, 7, 255, 319, 320, 2**31, 2**32 + 1, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64,
    2**70, -(2**63), -(2**63) - 1, -(10**30), 0.0, -0.0, 1e-38, 5e-324, 1e-5, 0.5, 0.999, 1.0, 1.0000001, 2.5, 1e308,
    -1e308, "", "a", "0", "1", "null", "true", "\u0000", "\n\r\t", "\x7f", "😀🔥", "é\u2028\ufeff", "image_url", "text",
    "fake-model", "tiny", "abc" * 100,
]
COMPOSITES = [
    [], [1], [[1, 2]], [None], ["a"], [2**70], [-1], [0.5], [True], {}, {"a": 1}, {"type": "text"},
    {"type": "text", "text": "hi"}, [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}],
    [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], [{"type": "text", "text": 5}], ["x", {"type": 1}],
    [{"role": "user", "content": "hi"}], [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    [{"role": 5}], [{"content": "no role"}], {"include_usage": True}, {"include_usage": "yes"},
]


def dumps(value: object) -> bytes:
    """JSON bytes; Raw values go in verbatim, so no Python recursion follows their nesting."""
    if isinstance(value, Raw):
        return bytes(value)
    if isinstance(value, dict):
        return b"{" + b",".join(json.dumps(str(k)).encode() + b":" + dumps(v) for k, v in value.items()) + b"}"
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(dumps(v) for v in value) + b"]"
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


def field_names(*structs: type) -> list[str]:
    return sorted({f.name for s in structs for f in msgspec.structs.fields(s)})


@dataclass(frozen=True)
class Route:
    """A route to fuzz: its valid bodies, the fields it knows, and those under `sampling_params`."""

    method: str
    path: str
    bases: tuple[dict, ...]
    fields: tuple[str, ...] = ()
    sampling_fields: tuple[str, ...] = ()
    quiet: bool = False  # needs or changes every worker's state (sleep, wake_up, reset): sent alone

    @property
    def generates(self) -> bool:
        return self.path in GENERATE_PATHS


def routes(prompt_ids: list[int], *, pd: bool = False) -> list[Route]:
    """The generate routes and the admin routes. `pd=True` leaves out `disagg_prefill_dp_rank`: in a
    P/D pair a valid rank that is not the one holding the KV makes both legs wait for their deadlines."""
    routed = [name for name in field_names(RoutedBody) if not (pd and name == "disagg_prefill_dp_rank")]
    short = {"max_tokens": 2, "temperature": 0}
    chat = [{"role": "user", "content": "hi"}]
    return [
        Route("POST", "/generate", (
            {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
            {"text": "hello", "sampling_params": {"max_new_tokens": 2}, "stream": True},
            {"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": 3}, "return_logprob": True,
             "top_logprobs_num": 2, "logprob_start_len": 0},
        ), tuple(field_names(SGLangBody) + routed), tuple(field_names(SGLangSampling))),
        Route("POST", "/v1/completions", (
            {"prompt": "hello", **short}, {"prompt": prompt_ids, **short, "stream": True, "logprobs": 2},
            {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
        ), tuple(field_names(CompletionBody) + routed)),
        Route("POST", "/v1/chat/completions", (
            {"messages": chat, **short}, {"messages": chat, **short, "stream": True, "logprobs": True, "top_logprobs": 2},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 2},
        ), tuple(field_names(ChatBody, StreamOptions) + routed)),
        Route("POST", "/inference/v1/generate", (
            {"token_ids": prompt_ids, "sampling_params": short},
            {"token_ids": prompt_ids, "sampling_params": {**short, "logprobs": 1, "prompt_logprobs": 1}, "stream": True},
        ), tuple(field_names(TokensBody) + routed), tuple(field_names(TokensSampling))),
        Route("POST", "/abort_requests", ({"rid": "nobody"}, {"abort_all": True}), ("rid", "abort_all")),
        # Refused (500 UtilityFailed, "returned False") while any request holds blocks, as vLLM's engine
        # refuses it: sent alone, when nothing runs.
        Route("POST", "/reset_prefix_cache", ({},), quiet=True),
        Route("POST", "/sleep", ({"level": 1}, {}), tuple(field_names(SleepBody)), quiet=True),
        Route("POST", "/wake_up", ({},), quiet=True),
        Route("GET", "/is_sleeping", ({},)),
        Route("GET", "/server_info", ({},)),
        Route("GET", "/health", ({},)),
    ]


@dataclass
class Fuzzed:
    """One request to send."""

    route: Route
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    query: str = ""


class BodyFuzzer:
    """Mutations drawn from one seeded random.Random: the same seed gives the same bodies."""

    def __init__(self, seed: int, max_string_chars: int):
        self.rng = random.Random(seed)
        self.max_string_chars = max_string_chars

    def value(self) -> object:
        roll = self.rng.random()
        if roll < 0.45:
            return self.rng.choice(SCALARS)
        if roll < 0.70:
            return copy.deepcopy(self.rng.choice(COMPOSITES))  # later mutations edit it in place
        if roll < 0.85:
            return self.rng.choice(RAW_VALUES)
        if roll < 0.90:
            return self.huge_string()
        if roll < 0.95:
            return [self.rng.choice(SCALARS) for _ in range(self.rng.randint(1, 200))]
        return "".join(chr(self.rng.choice([self.rng.randint(32, 0x2FF), self.rng.randint(0x370, 0xD7FF),
                                            self.rng.randint(0xE000, 0x10FFFF)])) for _ in range(self.rng.randint(1, 64)))

    def huge_string(self) -> str:
        size = self.rng.choice([1_000, 10_000, 100_000, self.max_string_chars])
        return self.rng.choice("xé😀 ") * size

    def mutate(self, body: dict, route: Route) -> object:
        body = json.loads(json.dumps(body))
        for _ in range(self.rng.choice([1, 1, 1, 2, 3])):
            body = self._mutate_once(body, route)
        return body

    def _mutate_once(self, body: object, route: Route) -> object:
        if not isinstance(body, dict) or self.rng.random() < 0.03:
            return self.value()  # the whole body: a list, a string, a number, null, ...
        op = self.rng.random()
        names = list(route.fields) or ["unknown"]
        if op < 0.45:
            body[self.rng.choice(names)] = self.value()
        elif op < 0.60 and route.sampling_fields:
            inner = body.get("sampling_params")
            inner = inner if isinstance(inner, dict) else {}
            inner[self.rng.choice(route.sampling_fields)] = self.value()
            body["sampling_params"] = inner
        elif op < 0.70 and body:
            del body[self.rng.choice(list(body))]
        elif op < 0.80:
            body[self.rng.choice(["zzz", "rid_extra", "log_metrics", "return_hidden_states", "tools", "user",
                                  "chat_template_kwargs", "😀"])] = self.value()
        elif op < 0.90 and body:
            key = self.rng.choice(list(body))
            body[key] = [body[key]] if self.rng.random() < 0.5 else self._unwrap(body[key])
        else:
            self._mutate_messages(body)
        return body

    def _unwrap(self, value: object) -> object:
        if isinstance(value, list) and value:
            return value[0]
        if isinstance(value, dict) and value:
            return next(iter(value.values()))
        return self.value()

    def _mutate_messages(self, body: dict) -> None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
            body["messages"] = copy.deepcopy(self.rng.choice(COMPOSITES))
            return
        message = messages[0]
        message[self.rng.choice(["role", "content", "name", "tool_calls"])] = self.value()

    def request(self, route: Route) -> Fuzzed:
        base = self.rng.choice(route.bases)
        raw = dumps(self.mutate(base, route) if self.rng.random() < 0.93 else base)
        roll = self.rng.random()
        if roll < 0.02:
            raw = raw[: self.rng.randint(0, max(len(raw) - 1, 0))]  # truncated
        elif roll < 0.03:
            raw = b"\xff\xfe" + raw  # not UTF-8
        elif roll < 0.04:
            raw = b""
        headers = {}
        if self.rng.random() < 0.08:
            headers["X-data-parallel-rank"] = str(self.rng.choice(["0", "1", "2", "-1", "abc", "", " 1 ", "1.5", "9" * 30]))
        if self.rng.random() < 0.05:
            headers["X-Request-Id"] = self.rng.choice(["hdr", "é", "x" * 300, "a b"])
        query = ""
        if route.quiet or route.method == "GET":
            query = self.rng.choice(["", "", "level=1", "level=2", "level=abc", "level=" + "9" * 50, "level=", "x=1"])
        return Fuzzed(route, raw, headers, query)


def check_answer(status: int, content_type: str, raw: bytes, what: str) -> list[str]:
    """What is wrong with one answer (empty when it is fine): no 5xx, OpenAI-shaped errors, SSE
    streams whose error events (if any) are client errors."""
    problems = []
    if status >= 500:
        problems.append(f"{what}: {status} {raw[:300]!r}")
    if status >= 400:
        problems += _error_shape(raw, what)
    elif "text/event-stream" in content_type:
        for block in raw.decode().split("\n\n"):
            if block.startswith("data: {") and '"error"' in block[:20]:
                problems += _error_shape(block[len("data: "):].encode(), what, stream=True)
    return problems


def _error_shape(raw: bytes, what: str, stream: bool = False) -> list[str]:
    try:
        body = json.loads(raw)
    except ValueError:
        return [f"{what}: error body is not JSON: {raw[:300]!r}"]
    error = body.get("error") if isinstance(body, dict) else None
    if set(body) != {"error"} or not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return [f"{what}: error body is not OpenAI-shaped: {raw[:300]!r}"]
    if not isinstance(error["message"], str) or not error["message"] or not isinstance(error["type"], str):
        return [f"{what}: error message or type missing: {raw[:300]!r}"]
    if stream and error["type"] in SERVER_ERROR_TYPES:
        return [f"{what}: server error in a stream: {raw[:300]!r}"]
    return []
