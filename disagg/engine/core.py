"""The engine core: one step at a time, schedule → run → update → emit.

Servers drive it step by step; the offline `LLM` loops it to completion. The P/D roles use its
generic hooks: reserve blocks for KV written elsewhere and admit the request when it lands, or hold
a finished request's blocks until a reader releases them.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from disagg.config import ConfigError
from disagg.engine_config import EngineConfig
from disagg.engine.grammar import GrammarCompiler
from disagg.engine.kv_cache_manager import KVCacheManager
from disagg.engine.kv_events import KVCacheEvent
from disagg.engine.loader import LoadedModel, load_model
from disagg.engine.model_runner import ModelRunner, RunnerOutput, SharedKV, kv_bytes_per_block
from disagg.engine.models.llama import LlamaModel
from disagg.engine.models.tensor_parallel import Collectives, shard_arch, shard_weights
from disagg.engine.output_processor import OutputProcessor
from disagg.engine.request import Request
from disagg.engine.resolve import (
    compatibility_record, engine_summary, resolve_dtype, resolve_kv_cache_dtype, resolve_quantization,
)
from disagg.engine.progress import CacheSpec, EngineStats, RequestProgress, Reservation
from disagg.engine.scheduler import SampledToken, Scheduler
from disagg.engine.step_metrics import StepLog, StepMetrics, measure
from disagg.engine.tokenizer import bad_words_token_ids
from disagg.ops.linear import dtype_name
from disagg.types import EngineSleeping, FinishReason, InvalidRequest, RequestOutput, SamplingParams


class EngineCore:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, tp: Collectives | None = None,
                 kv_file: str | None = None):
        """`tp`: this engine is one rank of a tensor-parallel group (models/tensor_parallel.py); every
        rank runs the same requests, holds its shard of the weights and of the KV heads, and samples
        from the same gathered logits. `kv_file`: the group's caches share it, so rank 0 moves all (SharedKV)."""
        self.config = config
        self.tp = tp
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_config, self.quantization_reason = resolve_quantization(config.model, 1 if tp is None else tp.size)
        config = self.config = dataclasses.replace(config, model=model_config)  # `auto` resolved
        self.loaded = loaded or load_model(config.model)
        self.tokenizer = self.loaded.tokenizer
        self.arch = self.loaded.arch
        self.rank_arch = self.arch if tp is None else shard_arch(self.arch, tp.rank, tp.size)  # its KV heads
        self.dtype = resolve_dtype(config.model.dtype, config.model.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        self.max_model_len = min(config.model.max_model_len or self.arch.max_position_embeddings, self.arch.max_position_embeddings)
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_blocks or self._blocks_that_fit()
        self.eos_token_ids = self.tokenizer.eos_token_ids
        model = self._build_model()
        self.shared_kv = None if kv_file is None or tp is None else SharedKV(kv_file, tp.rank, tp.size)
        self.engine_summary = engine_summary(config, self.dtype, self.kv_dtype, model, self.quantization_reason,
                                             kv_in_huge_pages=model.huge_pages and self.shared_kv is None)
        self.compatibility = compatibility_record(config, self.loaded, self.dtype, self.kv_dtype)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
        if self.shared_kv is not None and config.model.device != "cpu":
            raise ConfigError("a TP group moves its KV from one shared host region: prefill and decode servers "
                              f"with tensor_parallel_size > 1 run on the CPU, not on {config.model.device}")
        self.runner = ModelRunner(model, self.num_blocks, self.block_size, self.kv_dtype, self.eos_token_ids,
                                  config.model.seed, self.grammars, self.shared_kv)
        self.kv = KVCacheManager(self.num_blocks, self.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer)
        self.sleep_level = 0
        self._ids = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs of requests ended outside step()
        self.steps = StepLog()  # per-step metrics of the steps that ran the model (take_step_metrics)

    def _build_model(self) -> LlamaModel:
        model, weights = self.config.model, self.loaded.weights
        if self.tp is not None:
            if self.loaded.quantized:
                raise ConfigError("tensor parallelism splits dense weights: use --quantization none, int8 or int4")
            weights = shard_weights(weights, self.arch, self.tp.rank, self.tp.size)
        return LlamaModel(self.rank_arch, weights, self.dtype, model.device, model.quantization,
                          self.loaded.quantized, model.kernels, self.tp, model.huge_pages)

    def _blocks_that_fit(self) -> int:
        per_block = kv_bytes_per_block(self.rank_arch, self.block_size, self.kv_dtype)
        return max(self.config.cache.kv_cache_memory_mib * 2**20 // per_block, 2)

    # ---- requests -----------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def set_scheduler_limits(self, **limits: int) -> None:  # max_num_seqs, max_prefill_tokens_per_step; from the next step
        self.scheduler.config = dataclasses.replace(self.scheduler.config, **limits)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, hold_blocks: bool = False,
                    resume_token_ids: list[int] | tuple[int, ...] = (), priority: int = 0) -> None:
        """Queue a request. Raises InvalidRequest (bad input) or EngineSleeping. `resume_token_ids`:
        output tokens another engine already produced (a migration): computed with the prompt, counted
        by max_tokens, penalties and stops, never emitted again. `priority`: lower is served first
        under the priority scheduling policy; fcfs ignores it."""
        request = self._new_request(request_id, prompt_token_ids, params, hold_blocks, priority)
        if resume_token_ids:
            request.output_token_ids = list(resume_token_ids)
            request.logprobs = [{} for _ in resume_token_ids] if params.logprobs is not None else []
        self.scheduler.add(request)
        self.outputs.add(request)

    def _new_request(self, request_id, prompt_token_ids, params, hold_blocks, priority=0) -> Request:
        if self.sleep_level:
            raise EngineSleeping("the engine is sleeping; call wake_up() first")
        params = self.check_request(prompt_token_ids, params)
        if request_id in self.scheduler.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        return Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, hold_blocks, priority)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Admission: refuse (InvalidRequest) what could make a step raise or cannot fit the context.

        Returns `params` with `max_tokens` resolved: a value the client set must fit the context with
        the prompt (vLLM's rule and message); an unset one becomes the endpoint's default, capped by
        the rest of the context (or that rest when there is no default).
        """
        self.validate_prompt(prompt_token_ids)
        vocab = self.arch.vocab_size
        for token_id in params.stop_token_ids:
            if token_id >= vocab:
                raise InvalidRequest(f"stop token id {token_id} is out of vocabulary (vocab_size={vocab})", "stop_token_ids")
        for token_id in params.logprob_token_ids:
            if token_id >= vocab:
                raise InvalidRequest(f"token id {token_id} in token_ids_logprob is out of vocabulary (vocab_size={vocab})",
                                     "token_ids_logprob")
        params = self._check_processors(params)
        num_prompt, room = len(prompt_token_ids), self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is not None:
            if params.max_tokens > room:
                raise InvalidRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the messages, {params.max_tokens} in "
                    "the completion). Please reduce the length of the messages or completion.", "max_tokens")
            return params
        if params.min_tokens > room:
            raise InvalidRequest(
                f"min_tokens is {params.min_tokens}, but the prompt has {num_prompt} tokens and the context length is "
                f"{self.max_model_len}: at most {room} tokens can be generated", "min_tokens")
        default = params.default_max_tokens
        return dataclasses.replace(params, max_tokens=room if default is None else min(default, room))

    def _check_processors(self, params: SamplingParams) -> SamplingParams:
        """Refuse out-of-vocabulary ids in logit_bias / allowed_token_ids and invalid grammars;
        tokenize bad_words."""
        vocab = self.arch.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [token_id for token_id in ids if token_id >= vocab]  # every one named, as vLLM does
            if bad:
                which = f"token id {bad[0]}" if len(bad) == 1 else f"token ids {', '.join(map(str, bad))}"
                raise InvalidRequest(f"{which} in {name} {'is' if len(bad) == 1 else 'are'} out of vocabulary "
                                     f"(vocab_size={vocab})", name)
        if params.structured_output is not None:
            self.grammars.grammar(params.structured_output)  # raises InvalidRequest naming the field
        if not params.bad_words or params.bad_words_token_ids:
            return params
        words = bad_words_token_ids(self.tokenizer, params.bad_words)
        if any(t >= vocab for word in words for t in word):
            raise InvalidRequest(f"bad_words tokenize to ids outside the vocabulary (vocab_size={vocab})", "bad_words")
        return dataclasses.replace(params, bad_words_token_ids=words)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if len(prompt_token_ids) == 0:
            raise InvalidRequest("the prompt is empty: it must contain at least one token", "prompt")
        vocab = self.arch.vocab_size
        for token_id in prompt_token_ids:
            if not isinstance(token_id, int) or not 0 <= token_id < vocab:
                raise InvalidRequest(f"token id {token_id!r} is out of vocabulary (vocab_size={vocab})", "prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt_token_ids)} tokens; the context length is {self.max_model_len}, "
                f"so a prompt may have at most {self.max_model_len - 1} tokens",
                "prompt",
            )
        needed = self.kv.blocks_needed(len(prompt_token_ids) + 1)
        if needed > self.num_blocks:
            raise InvalidRequest(f"the prompt needs {needed} KV blocks; the cache holds {self.num_blocks}", "prompt")

    def abort(self, request_id: str, answer: bool = True) -> bool:
        """Abort a request at any stage; its blocks are freed and, unless the caller answers it itself
        (`answer` False), a final output is queued."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return False
        self._finish_output(request, answer)
        return True

    def fail(self, request_id: str, reason: str) -> bool:
        """End a request because the engine could not run it: like abort, with `reason` as its error."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        request.error = reason
        return self.abort(request_id)

    # ---- P/D hooks ----------------------------------------------------------------------------

    def reserve_for_remote_kv(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                              priority: int = 0) -> Reservation | None:
        """Reserve blocks for a prompt whose KV another engine writes; None when the cache is full.
        The prompt's cached prefix is reused: only the blocks after `num_cached_tokens` need its KV.
        `priority` orders the request's preemption once it runs (the priority policy)."""
        request = self._new_request(request_id, prompt_token_ids, params, False, priority)
        if not self.scheduler.reserve_for_remote_kv(request):
            return None
        self.outputs.add(request)
        return Reservation(list(request.block_ids), request.num_prompt_tokens, request.num_cached_tokens, self.block_size)

    def admit_remote_kv(self, request_id: str, first_token_id: int, first_logprobs: dict[int, float] | None = None,
                        prompt_logprobs: list[dict[int, float] | None] | None = None,
                        num_cached_tokens: int | None = None, prompt_ranks: list[int | None] | None = None) -> bool:
        """The prompt's KV landed in the reserved blocks; continue from the first token, with the
        prompt logprobs the remote engine computed (first entry None, as for their ranks) and, as this
        request's cached tokens, those it found in its prefix cache. False when the request no longer waits for KV
        (it was aborted or failed meanwhile)."""
        first = SampledToken(first_token_id, first_logprobs)
        request = self.scheduler.admit_remote_kv(request_id, first, prompt_logprobs, prompt_ranks)
        if request is None:
            return False
        if num_cached_tokens is not None:
            request.num_cached_tokens = num_cached_tokens
        params = request.sampling_params
        if params.seed is not None and not params.greedy:
            self.runner.sampler.skip_draw(request_id, params.seed, self.arch.vocab_size)
        self._collect(request)
        return True

    def admit_remote_prefix(self, request_id: str, num_computed_tokens: int, num_cached_tokens: int | None = None) -> bool:
        """The KV of the prompt's first `num_computed_tokens` landed in the reserved blocks (pull
        flow: this engine read it); the rest of the prompt and every output token are computed here.
        `num_cached_tokens`: what the remote engine found cached, reported as this request's. False
        when the request no longer waits for KV."""
        request = self.scheduler.admit_remote_prefix(request_id, num_computed_tokens)
        if request is not None and num_cached_tokens is not None:
            request.num_cached_tokens = num_cached_tokens
        return request is not None

    def cached_prefix_tokens(self, prompt_token_ids: list[int]) -> int:
        """Leading prompt tokens this engine's prefix cache holds now (whole blocks; the decode's
        local-prefill rule reads it)."""
        return self.kv.cached_prefix_tokens(prompt_token_ids)

    def request_progress(self, request_id: str) -> RequestProgress | None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return None
        return RequestProgress(list(request.block_ids), request.num_computed_tokens, request.num_prompt_tokens, request.is_finished)

    def cache_spec(self) -> CacheSpec:
        cache = self.runner.kv_cache
        assert cache is not None, "the KV cache is freed (sleeping)"
        if self.tp is not None and self.shared_kv is None:
            raise ConfigError("one TP rank's KV cache is not the group's: start the group with a shared KV file")
        a, tp_size = self.arch, 1 if self.tp is None else self.tp.size  # rank 0's cache opens the group's region
        return CacheSpec(cache.data_ptr(), self.num_blocks, a.num_layers, self.block_size, a.num_kv_heads, a.head_dim,
                         dtype_name(cache.dtype), str(cache.device), tp_size)

    def release(self, request_id: str) -> bool:
        """Free the blocks a finished `hold_blocks` request kept, or those of a request that ended
        while waiting for remote KV (quarantined until the caller knows no write can land)."""
        return self.scheduler.release(request_id)

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step: schedule, run the model, update requests, emit their outputs."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if scheduled.seqs:
            result = self.runner.execute(scheduled)
            self._record(result)
            for request in self.scheduler.update(scheduled, result.sampled):
                self._collect(request)
            self.steps.add(measure(scheduled, time.perf_counter() - start, self.scheduler.num_running,
                                   self.scheduler.num_waiting))
        self._collect_scheduler_finished()
        return self.take_outputs()

    def take_step_metrics(self) -> list[StepMetrics]:
        """The steps that ran the model since the last call, oldest first (at most the last 4096)."""
        return self.steps.take()

    def _record(self, result: RunnerOutput) -> None:
        """What a run tells besides the sampled tokens: requests whose part failed (they fail alone)
        and the prompt logprobs it computed."""
        for request_id, reason in result.failed.items():
            self.fail(request_id, f"engine step failed for request {request_id}: {reason}")
        for request_id, logprobs in result.prompt_logprobs.items():
            if (request := self.scheduler.requests.get(request_id)) is not None:
                first = [] if request.prompt_logprobs else [None]  # the first prompt token has none
                request.prompt_logprobs.extend(first + logprobs)
                request.prompt_ranks.extend(first + result.prompt_ranks[request_id])

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs queued outside a step (aborts, remote admissions), without stepping."""
        pending, self._pending = self._pending, []
        return pending

    def warm_up(self) -> None:
        """One short generation so the first real request does not pay for kernel set-up."""
        request_id = "warm-up"
        self.add_request(request_id, [self.tokenizer.bos_token_id or 1] * 8, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while self.has_unfinished():
            self.step()
        self.reset_prefix_cache()
        self.steps.take()  # not the served requests' steps

    def _collect(self, request: Request) -> None:
        if request.output_token_ids and self.outputs.check_stop_strings(request) is not None and not request.is_finished:
            self.scheduler.finish(request, FinishReason.STOP, self.outputs.streams[request.request_id].stopped_by)
        if request.is_finished:
            self._finish_output(request)
        elif request.output_token_ids:
            self._pending.append(self.outputs.emit(request))

    def _finish_output(self, request: Request, answer: bool = True) -> None:
        # An aborted request is finished at once and again when the scheduler's finished list is
        # drained; by then a new request may carry its id: only the owner of the stream reports.
        if not self.outputs.owns(request):
            return
        if answer:
            self.outputs.check_stop_strings(request)
            self._pending.append(self.outputs.emit(request))
        self.outputs.remove(request)
        self.runner.sampler.forget(request.request_id)

    def _collect_scheduler_finished(self) -> None:
        """Requests the scheduler ended on its own (e.g. out of cache) still owe a final output."""
        for request in self.scheduler.drain_finished():
            self._finish_output(request)

    def has_unfinished(self) -> bool:
        """Work to step, or outputs still owed: a remote admission whose first token ends the request
        (EOS, max_tokens 1) queues its final output outside a step, and only a step delivers it."""
        return self.scheduler.has_work() or bool(self._pending)

    # ---- utilities ----------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def enable_kv_events(self) -> None:
        """Record the prefix cache's changes (blocks stored, removed, all cleared) from now on."""
        self.kv.enable_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, oldest first (empty unless enabled)."""
        return self.kv.take_events()

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache, and on CUDA the device's weights too (the host copy the engine
        loaded stays, and wake_up moves it back); level 2 also drops the host copy. Unfinished
        requests are aborted."""
        if level not in (1, 2):
            raise InvalidRequest(f"sleep level must be 1 or 2, got {level}", "level")
        for request_id in list(self.scheduler.requests):
            self.abort(request_id)
        for request_id in list(self.scheduler.holding):
            self.release(request_id)  # the cache itself goes away: nothing can be written into it
        self.kv.reset_prefix_cache()  # what the index names is gone with the memory (AllBlocksCleared)
        self.runner.free_kv_cache()
        on_cuda = self.config.model.device.startswith("cuda")
        if level == 2 or on_cuda:
            self.runner.model = None
        if level == 2:
            self.loaded = None
        if on_cuda:
            torch.cuda.empty_cache()  # back to the device, not only to torch's caching allocator
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        if self.sleep_level == 0:
            return
        if self.loaded is None:
            self.loaded = load_model(self.config.model)
        if self.runner.model is None:
            self.runner.model = self._build_model()
        self.runner.allocate_kv_cache()
        self.kv.reset()
        self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def stats(self) -> EngineStats:
        return EngineStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                           num_free_blocks=self.kv.num_free_blocks, num_total_blocks=self.num_blocks,
                           num_quarantined_blocks=self.scheduler.num_quarantined_blocks,
                           prefix_cache_queries=self.scheduler.prefix_cache_queries,
                           prefix_cache_hits=self.scheduler.prefix_cache_hits)
