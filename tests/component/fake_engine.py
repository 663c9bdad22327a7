"""An in-process EngineClient twin for the HTTP tests, plus helpers to serve it on 127.0.0.1:0.

Deterministic "model": the i-th generated token (0-based) is `FIRST_OUTPUT_ID + i`, its text is
`" w<id>"`. It honours max_tokens ("length"; 0: the prompt only), stop_token_ids and stop strings ("stop", with
`stop_reason`), logprobs (sampled token first at -0.5, then top-n: id + k at -0.5 - k, then the
logprob_token_ids at -9), prompt logprobs, the prompt back and token texts. A prompt counts one token per token id, or one per whitespace-separated word of `prompt`
and of every message's content. Scripted behaviours: per-worker sleeping flags and
reset_prefix_cache answers, dead workers, an error output or an exception after k tokens, a delay
between tokens. It records every request, every aborted request and every utility call. The
`tokenize` and `detokenize` utilities follow `fake_tokenize` and `token_text`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from aiohttp.test_utils import TestClient, TestServer

from disagg.api.app import create_app
from disagg.config import DisaggregationMode, ServerConfig
from disagg.config import LoadBalanceMethod
from disagg.dp.dispatch import Dispatcher, routing_prompt
from disagg.dp.protocol import DispatchStats, ModelCard, UtilityFailed, WorkerState, WorkerUnavailable
from disagg.types import FinishReason, InvalidRequest
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg, TokenizeMsg

FAKE_MODEL = ModelCard(name="fake-model", max_model_len=64, vocab_size=1000)
LONG_MODEL = ModelCard(name="fake-model", max_model_len=4096, vocab_size=1000)  # for requests that must run long
FIRST_OUTPUT_ID = 100


def token_text(token_id: int) -> str:
    return f" w{token_id}"


@dataclass
class Scripted:
    """Failures to inject. `*_after` counts output tokens sent before the failure."""

    error_after: int | None = None  # then OutputMsg(error=..., error_status=error_status)
    error_status: int = 500
    error_text: str = "worker failed"
    raise_after: int | None = None  # then the iterator raises WorkerUnavailable


class FakeEngine:
    """Implements disagg.dp.protocol.EngineClient in-process, deterministically."""

    def __init__(self, dp_size: int = 2, *, load_balance_method: str = "round_robin",
                 model: ModelCard = FAKE_MODEL, token_delay_s: float = 0.0, num_cached_tokens: int = 0,
                 queued_s: float | None = None):
        self.dp_size = dp_size
        self.load_balance_method = load_balance_method
        self.mode = DisaggregationMode.NULL
        self.pd_roles = None  # no role switch
        self.model = model
        self.queued_s = queued_s  # the final output's queue time (the engine's; None: not reported)
        self.token_delay_s = token_delay_s
        self.num_cached_tokens = num_cached_tokens
        self.script = Scripted()
        self.sleeping = [False] * dp_size
        self.reset_ok = [True] * dp_size
        self.alive = [True] * dp_size
        self.utility_results: dict[str, list[object]] = {}  # method -> forced results
        self.requests: list[tuple[GenerateMsg, int]] = []
        self.aborted: list[str] = []  # requests whose iterator was closed before they finished
        self.abort_calls: list[tuple[str, bool]] = []  # engine.abort(request_id) -> found
        self.utility_calls: list[tuple[str, tuple]] = []
        self.utility_ranks: list[list[int] | None] = []  # the `ranks` of each utility call (None: all)
        self._abort_flags: dict[str, asyncio.Event] = {}
        self._running: dict[str, int] = {}
        self._next_rank = 0
        self.dispatcher = Dispatcher(LoadBalanceMethod.CACHE_AWARE, dp_size)  # cache_aware: the real pick
        self.states: list[WorkerState] | None = None  # what worker_states() reports, when set (load tests)
        self.step_reports: list = []  # StepsMsg the next scrape takes (the workers' step reports)

    async def refresh_stats(self) -> None:
        """The fake's states are always current."""

    def take_step_reports(self) -> list:
        taken, self.step_reports = self.step_reports, []
        return taken

    @property
    def role_info(self) -> dict:
        return {} if self.pd_roles is None else self.pd_roles.info()

    def pick_rank(self, routed_dp_rank: int | None, bootstrap_room: int | None, msg: GenerateMsg | None = None) -> int:
        """Like the DP controller: a pinned rank must exist; else the load-balance method decides
        (cache_aware by the controller's Dispatcher, a worker's load its requests running)."""
        if routed_dp_rank is not None:
            if not 0 <= routed_dp_rank < self.dp_size:
                raise InvalidRequest(f"DP rank {routed_dp_rank} is not active (dp_size={self.dp_size})",
                                     "routed_dp_rank")
            return routed_dp_rank
        if self.load_balance_method == "follow_bootstrap_room":
            if bootstrap_room is None:
                raise InvalidRequest("bootstrap_room is required with load_balance_method=follow_bootstrap_room",
                                     "bootstrap_room")
            return bootstrap_room % self.dp_size
        if self.load_balance_method == "cache_aware":
            loads = [sum(1 for r in self._running.values() if r == rank) for rank in range(self.dp_size)]
            return self.dispatcher.pick(None, bootstrap_room, loads, self.alive, routing_prompt(msg) if msg else "")
        rank, self._next_rank = self._next_rank, (self._next_rank + 1) % self.dp_size
        return rank

    async def generate(self, msg: GenerateMsg, dp_rank: int) -> AsyncIterator[OutputMsg]:
        """Outputs one token per message; closing early counts as an abort."""
        self.requests.append((msg, dp_rank))
        if not self.alive[dp_rank]:
            raise WorkerUnavailable(f"DP worker {dp_rank} is not running")
        rid = msg.request_id
        self._abort_flags[rid] = asyncio.Event()
        self._running[rid] = dp_rank
        finished = False
        try:
            async for out in self._outputs(msg, dp_rank):
                finished = out.finish_reason is not None or out.error is not None
                yield fake_token_texts(msg, out)
        finally:
            if not finished:
                self.aborted.append(rid)
            self._abort_flags.pop(rid, None)
            self._running.pop(rid, None)

    async def _outputs(self, msg: GenerateMsg, dp_rank: int) -> AsyncIterator[OutputMsg]:
        rid, sp = msg.request_id, msg.sampling
        num_prompt = prompt_length(msg)
        rejection = self._rejection(msg, dp_rank, num_prompt)
        if rejection is not None:
            yield rejection
            return
        text = ""
        limit = self._max_tokens(sp, num_prompt)
        if limit == 0:  # prompt only (scoring): its logprobs, no token
            yield OutputMsg(rid, finish_reason=FinishReason.LENGTH, prompt_logprobs=self._prompt_logprobs(msg),
                            prompt_ranks=self._prompt_ranks(msg),
                            num_prompt_tokens=num_prompt, num_cached_tokens=self.num_cached_tokens,
                            **prompt_fields(msg))
            return
        for i in range(limit):
            await asyncio.sleep(self.token_delay_s)
            if self._abort_flags[rid].is_set():
                yield OutputMsg(rid, finish_reason=FinishReason.ABORT, num_prompt_tokens=num_prompt, num_output_tokens=i)
                return
            if self.script.error_after == i:
                yield OutputMsg(rid, error=self.script.error_text, error_status=self.script.error_status)
                return
            if self.script.raise_after == i:
                raise WorkerUnavailable("DP worker died mid-request")
            token_id = FIRST_OUTPUT_ID + i
            new_text, finish, stop_reason = self._step_text(sp, text, token_id, i, limit)
            text += new_text
            yield OutputMsg(
                rid, new_token_ids=[token_id], new_text=new_text, finish_reason=finish, stop_reason=stop_reason,
                logprobs=[fake_logprobs(token_id, sp.logprobs, extra_ids=sp.logprob_token_ids)]
                if sp.logprobs is not None else None,
                prompt_logprobs=self._prompt_logprobs(msg) if i == 0 else None,
                prompt_ranks=self._prompt_ranks(msg) if i == 0 else None,
                num_prompt_tokens=num_prompt, num_cached_tokens=self.num_cached_tokens, num_output_tokens=i + 1,
                **(prompt_fields(msg) if i == 0 else {}),
                **({"queued_s": self.queued_s, "num_preemptions": 1} if finish is not None and self.queued_s else {}),
            )
            if finish is not None:
                return

    def _rejection(self, msg: GenerateMsg, dp_rank: int, num_prompt: int) -> OutputMsg | None:
        if self.sleeping[dp_rank]:
            return OutputMsg(msg.request_id, error="the engine is sleeping; call wake_up() first", error_status=503)
        if num_prompt >= self.model.max_model_len:
            return OutputMsg(msg.request_id, error=f"the prompt has {num_prompt} tokens; the context length is "
                             f"{self.model.max_model_len}", error_status=400, error_param="prompt")
        max_tokens = msg.sampling.max_tokens
        if max_tokens is not None and num_prompt + max_tokens > self.model.max_model_len:
            return OutputMsg(msg.request_id, error=f"This model's maximum context length is {self.model.max_model_len} "
                             f"tokens. However, you requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                             f"messages, {max_tokens} in the completion). Please reduce the length of the messages or "
                             "completion.", error_status=400, error_param="max_tokens")
        return None

    def _max_tokens(self, sp, num_prompt: int) -> int:
        """As the engine resolves it: the client's value, else the endpoint's default capped by the context."""
        if sp.max_tokens is not None:
            return sp.max_tokens
        room = self.model.max_model_len - num_prompt
        return room if sp.default_max_tokens is None else min(sp.default_max_tokens, room)

    @staticmethod
    def _step_text(sp, text: str, token_id: int, i: int, limit: int) -> tuple[str, str | None, str | int | None]:
        new_text = token_text(token_id)
        if token_id in sp.stop_token_ids and i + 1 > sp.min_tokens:
            return ("", "stop", token_id) if not sp.include_stop_str_in_output else (new_text, "stop", token_id)
        whole = text + new_text
        for stop in sp.stop:
            at = whole.find(stop)
            if at >= 0:
                end = at + len(stop) if sp.include_stop_str_in_output else at
                return whole[len(text):end], "stop", stop
        return new_text, ("length" if i + 1 == limit else None), None

    def _prompt_logprobs(self, msg: GenerateMsg):
        n = msg.sampling.prompt_logprobs
        if n is None:
            return None
        ids = msg.prompt_token_ids or [7] * prompt_length(msg)
        return [None] + [fake_logprobs(t, n, -1.0, msg.sampling.logprob_token_ids) for t in ids[1:]]

    @staticmethod
    def _prompt_ranks(msg: GenerateMsg) -> list[int | None] | None:
        """Each prompt token is its own top-1 in `_prompt_logprobs`: rank 1."""
        return None if msg.sampling.prompt_logprobs is None else [None] + [1] * (prompt_length(msg) - 1)

    async def abort(self, request_id: str) -> bool:
        flag = self._abort_flags.get(request_id)
        self.abort_calls.append((request_id, flag is not None))
        if flag is not None:
            flag.set()
        return flag is not None

    async def call_utility(self, method: str, *args, ranks: list[int] | None = None) -> list[object]:
        self.utility_calls.append((method, args))
        self.utility_ranks.append(ranks)
        called = list(range(self.dp_size)) if ranks is None else ranks
        if not all(self.alive[r] for r in called):
            raise WorkerUnavailable(f"{method}: DP worker {next(r for r in called if not self.alive[r])} is not running")
        if method in self.utility_results:
            return list(self.utility_results[method])
        if method == "tokenize":
            return [fake_tokenize(args[0]) for _ in called]
        if method == "detokenize":
            return ["".join(token_text(t) for t in args[0]) for _ in called]
        if method == "is_sleeping":
            return list(self.sleeping)
        if method in ("sleep", "wake_up"):
            self.sleeping = [method == "sleep"] * self.dp_size
            return [None] * self.dp_size
        if method == "reset_prefix_cache":
            return list(self.reset_ok)
        raise UtilityFailed(method, {r: f"unknown utility {method!r}" for r in range(self.dp_size)})

    def dispatch_stats(self) -> DispatchStats:
        return DispatchStats(self.dispatcher.num_cache_hits, self.dispatcher.num_cache_misses)

    def worker_states(self) -> list[WorkerState]:
        if self.states is not None:
            return list(self.states)
        return [
            WorkerState(dp_rank=r, alive=self.alive[r], ready=self.alive[r],
                        num_running=sum(1 for v in self._running.values() if v == r), num_waiting=r,
                        num_free_blocks=100 - r, num_total_blocks=128, num_outstanding_requests=0, num_restarts=r,
                        num_quarantined_blocks=3 * r, block_size=16)
            for r in range(self.dp_size)
        ]

    def healthy(self) -> bool:
        return all(self.alive)


def prompt_fields(msg: GenerateMsg) -> dict:
    """The prompt's ids and text, when the request asks for them back: ids as sent, or 7 per word;
    the text of an id is `<id>` (a space between ids)."""
    if not msg.return_prompt:
        return {}
    ids = msg.prompt_token_ids or [7] * prompt_length(msg)
    return {"prompt_token_ids": ids, "prompt_text": " ".join(f"<{t}>" for t in ids)}


def prompt_length(msg: GenerateMsg) -> int:
    if msg.prompt_token_ids is not None:
        return len(msg.prompt_token_ids)
    if msg.prompt is not None:
        return len(msg.prompt.split())
    return sum(len(str(m.get("content") or "").split()) for m in msg.messages or [])


def fake_tokenize(msg: TokenizeMsg) -> dict:
    """One token per whitespace-separated word, its id the word's length + 10 (BOS 1 with
    add_special_tokens); a chat renders as `<role> content` per message, `<assistant>` last with
    add_generation_prompt. Token strings are the words."""
    if msg.messages is None:
        text = msg.prompt
    else:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in msg.messages)
        text += " <assistant>" if msg.add_generation_prompt else ""
    words = text.split()
    tokens = [1] * msg.add_special_tokens + [len(w) + 10 for w in words]
    strs = ["<s>"] * msg.add_special_tokens + words if msg.return_token_strs else None
    return {"tokens": tokens, "token_strs": strs}


def fake_logprobs(token_id: int, top_n: int, base: float = -0.5, extra_ids=()) -> list[tuple[int, float]]:
    """(sampled, lp) first, then the top-n: id + k at lp - k, then each of `extra_ids` at -9."""
    return [(token_id, base)] + [(token_id + k, base - k) for k in range(top_n)] + [(t, -9.0) for t in extra_ids]


def fake_token_texts(msg: GenerateMsg, out: OutputMsg) -> OutputMsg:
    """`out` with the texts of every id in its logprobs and prompt, when the request asks for them."""
    if not msg.return_token_texts:
        return out
    entries = (out.logprobs or []) + [e for e in out.prompt_logprobs or [] if e is not None]
    ids = {t for e in entries for t, _ in e} | set(out.prompt_token_ids or [])
    return msgspec.structs.replace(out, token_texts={t: token_text(t) for t in ids})


@contextlib.asynccontextmanager
async def api_client(engine: FakeEngine, **config) -> AsyncIterator[TestClient]:
    """A TestClient talking real HTTP to create_app(ServerConfig(**config), engine) on 127.0.0.1:0."""
    server = ServerConfig(port=0, **config)
    if isinstance(engine, FakeEngine):
        engine.mode = server.disaggregation_mode  # as a real front takes it from its ServerConfig
    app = create_app(server, engine, configure_logs=False)
    async with TestClient(TestServer(app, host="127.0.0.1", port=0)) as client:
        yield client


def sse_events(raw: str) -> list[object]:
    """The `data:` payloads of an SSE body, JSON-decoded; `[DONE]` stays a string."""
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    """Poll `predicate` until it holds; fails the test past `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def bad_request(message: str, param: str | None = None) -> dict:
    """The OpenAI-shaped body of a 400: what every endpoint answers to bad input."""
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": None}}


async def open_generate_streams(client: TestClient, rids: tuple[str, ...], max_new_tokens: int = 500) -> list:
    """One streaming /generate per rid, each read up to its first event (so every one is running)."""
    streams = [await client.post("/generate", json={"text": "a", "rid": rid, "stream": True,
                                                    "sampling_params": {"max_new_tokens": max_new_tokens}})
               for rid in rids]
    for resp in streams:
        await resp.content.readuntil(b"\n\n")
    return streams
