"""The unified worker role: one EngineCore behind wire messages (GenerateMsg in, OutputMsg out).

Tokenization, chat templates and detokenization happen here, so the HTTP front stays torch- and
tokenizer-free. One bad request becomes one error OutputMsg; it never stops the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import msgspec
import structlog

from disagg.engine.core import EngineCore
from disagg.types import FaultKind, FinishReason, InvalidRequest, RequestOutput, SamplingParams
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg, ReadyMsg, StatsMsg, Utility
from disagg.worker import tokenization
from disagg.worker.outputs import admission_error, to_output_msg

log = structlog.get_logger(__name__)


def truncated(ids: list[int], sampling: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt after vLLM's `truncate_prompt_tokens` (-1: the context length) from `truncation_side`."""
    keep = sampling.truncate_prompt_tokens
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    if len(ids) <= keep:
        return ids
    return ids[-keep:] if sampling.truncation_side == "left" else ids[:keep]


class UnifiedRole:
    """The unified (non-disaggregated) worker: every request runs start to end on this engine. The
    P/D roles build on it (disagg/worker/transfer.py) and add the KV transfer.
    Implements disagg/worker/role.py's Role."""

    can_sleep = True  # the P/D roles register the KV cache with peers: freeing it would break them
    fault_injection = False  # the server's --enable-fault-injection, set by the worker before start()
    step_delay_s = 0.0  # a slow_steps fault: the worker sleeps this long before each engine step

    def __init__(self, core: EngineCore, dp_rank: int, model_name: str):
        self.core = core
        self.dp_rank = dp_rank
        self.model_name = model_name
        self._started: set[str] = set()  # requests whose first OutputMsg went out
        self._return_prompt: set[str] = set()  # requests whose first OutputMsg carries the prompt
        self._return_texts: set[str] = set()  # requests whose OutputMsgs carry their logprob tokens' texts
        self.wake: Callable[[], None] = lambda: None  # set by the worker loop

    def ready_msg(self) -> ReadyMsg:
        core = self.core
        return ReadyMsg(self.dp_rank, self.model_name, core.max_model_len, core.arch.vocab_size, core.num_blocks,
                        core.block_size, core.engine_summary, core.compatibility, list(core.eos_token_ids))

    def prompt_ids(self, msg: GenerateMsg) -> list[int]:
        """The request's prompt as token ids, checked for admission with the request's own sampling
        (vocabulary, stop ids, the context with its max_tokens): every role refuses what the
        unified engine refuses, though a prefill runs it with max_tokens 1. Raises InvalidRequest."""
        ids = truncated(self._tokenize(msg), msg.sampling, self.core.max_model_len)
        self.core.check_request(ids, msg.sampling)
        return ids

    def _tokenize(self, msg: GenerateMsg) -> list[int]:
        tokenizer = self.core.tokenizer
        if msg.prompt_token_ids is not None:
            return list(msg.prompt_token_ids)
        if msg.messages is not None:  # the template writes the special tokens; add_special_tokens adds more (vLLM)
            text = tokenization.chat_text(tokenizer, msg, msg.chat_template_kwargs)
            return tokenizer.encode(text, add_special_tokens=msg.add_special_tokens)
        if msg.prompt is not None:
            return tokenizer.encode(msg.prompt, add_special_tokens=msg.add_special_tokens)
        raise InvalidRequest("the request has no prompt", "prompt")

    def note(self, msg: GenerateMsg) -> None:
        """Remember what a request's answers must carry, before any role's submit() runs it."""
        if msg.return_prompt:
            self._return_prompt.add(msg.request_id)
        if msg.return_token_texts:
            self._return_texts.add(msg.request_id)

    def sent(self, msgs: list) -> None:
        """Messages on their way to the front: forget what `note` kept for requests that ended
        (whichever path answered them: the engine, an admission error, a failed transfer)."""
        for msg in msgs:
            if isinstance(msg, OutputMsg) and (msg.finish_reason is not None or msg.error is not None):
                self._return_prompt.discard(msg.request_id)
                self._return_texts.discard(msg.request_id)

    async def start(self) -> None:
        """Set up what the role needs beyond the engine (the roles: transfer agents, servers)."""

    async def close(self) -> None:
        """Release what start() set up."""

    def idle_wait_s(self, default_s: float) -> float:
        """How long the worker may wait for messages when the engine is idle."""
        return default_s

    async def poll(self) -> list[OutputMsg]:
        """Advance background work between engine steps (the roles: KV transfers)."""
        return []

    async def submit(self, msg: GenerateMsg) -> list[OutputMsg]:
        """Queue a request; a rejected one answers at once with its error, and the worker goes on."""
        try:
            self.core.add_request(msg.request_id, self.prompt_ids(msg), msg.sampling,
                                  resume_token_ids=msg.resume_token_ids or (), priority=msg.priority)
        except Exception as exc:  # noqa: BLE001 - one request's input never stops the worker
            return [admission_error(msg.request_id, exc)]
        return []

    async def abort(self, request_id: str) -> list[OutputMsg]:
        self.core.abort(request_id)
        return self._convert(self.core.take_outputs())

    def has_work(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[OutputMsg]:
        return self._convert(self.core.step())

    def _convert(self, outputs: list[RequestOutput]) -> list[OutputMsg]:
        """Engine outputs as wire messages; a request the engine failed becomes its error (500).

        The P/D roles override this to hold or route their requests' answers. It may run in the
        engine-step thread: overrides only record state there, and act on it in poll()."""
        msgs = []
        for out in outputs:
            first = out.request_id not in self._started
            self._started.add(out.request_id)
            if out.error is not None:
                msgs.append(OutputMsg(out.request_id, finish_reason=FinishReason.ABORT, error=out.error, error_status=500))
            else:
                msgs.append(self._with_texts(self._with_prompt(to_output_msg(out, first), out, first)))
            if out.finished:
                self._started.discard(out.request_id)
        return msgs

    def _with_texts(self, msg: OutputMsg) -> OutputMsg:
        if msg.request_id not in self._return_texts:
            return msg
        entries = (msg.logprobs or []) + [e for e in msg.prompt_logprobs or [] if e is not None]
        ids = {t for entry in entries for t, _ in entry} | set(msg.prompt_token_ids or [])
        decode = self.core.tokenizer.decode
        return msgspec.structs.replace(msg, token_texts={t: decode([t], skip_special_tokens=False) for t in sorted(ids)})

    def _with_prompt(self, msg: OutputMsg, out: RequestOutput, first: bool) -> OutputMsg:
        if not first or out.request_id not in self._return_prompt:
            return msg
        text = self.core.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
        return msgspec.structs.replace(msg, prompt_token_ids=list(out.prompt_token_ids), prompt_text=text)

    def fail_all(self, exc: Exception) -> list[OutputMsg]:
        """An engine step crashed outside any one request: end every request with the error, keep
        the worker alive. (A request whose own part of a step raises fails alone, in EngineCore.step.)"""
        for request_id in list(self.core.scheduler.requests):
            self.core.fail(request_id, f"engine step failed: {type(exc).__name__}: {exc}")
        return self._convert(self.core.take_outputs())

    def utility(self, method: Utility, args: list) -> object:
        """Run one utility call: a table, one entry per Utility member."""
        core, tokenizer = self.core, self.core.tokenizer
        table: dict[Utility, Callable[..., object]] = {
            Utility.IS_SLEEPING: core.is_sleeping, Utility.SLEEP: self._sleep, Utility.WAKE_UP: core.wake_up,
            Utility.RESET_PREFIX_CACHE: core.reset_prefix_cache, Utility.STATS: self.stats,
            Utility.TOKENIZE: partial(tokenization.tokenize, tokenizer),
            Utility.DETOKENIZE: partial(tokenization.detokenize, tokenizer),
            Utility.TOKENIZER_INFO: partial(tokenization.tokenizer_info, tokenizer, self.model_name),
            Utility.INJECT_FAULT: self.inject_fault, Utility.HOLDING: self.holding,
        }
        return table[method](*args)

    def holding(self) -> str | None:
        if not self.core.has_unfinished():
            return None
        stats = self.core.stats()
        return f"{stats.num_running + stats.num_waiting} requests in the engine"

    def inject_fault(self, name: str, params: dict) -> None:
        """A worker-side fault the front checked (disagg/dp/faults.py), by its FaultKind's value: here
        only slow_steps; the P/D roles also take the transfer faults (disagg/worker/transfer.py)."""
        kind = FaultKind(name)
        if kind is not FaultKind.SLOW_STEPS:
            raise InvalidRequest(f"fault {kind!r} needs a prefill or decode worker", "kind")
        self.step_delay_s = params["ms"] / 1000
        log.warning("fault injected", fault=kind, **params)

    def _sleep(self, level: int = 1) -> None:
        if not self.can_sleep:
            raise InvalidRequest(
                "sleep is not supported on prefill/decode workers: their KV cache is registered with the "
                "transfer backend and its peers", "method")
        self.core.sleep(level)

    def stats(self) -> StatsMsg:
        return StatsMsg(**dataclasses.asdict(self.core.stats()))
