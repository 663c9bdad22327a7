"""Turns engine progress into RequestOutputs: incremental detokenization and stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.engine.request import Request
from disagg.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg.types import CompletionOutput, FinishReason, RequestOutput


@dataclass
class _Stream:
    request: Request  # the owner: a request id may be reused as soon as its request has ended
    detokenizer: IncrementalDetokenizer
    num_emitted_tokens: int = 0
    text: str = ""
    num_emitted_chars: int = 0
    num_reported_tokens: int = 0
    stopped_by: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}

    def add(self, request: Request) -> None:
        params = request.sampling_params
        # Output tokens it starts with (a migration) read as context: their text was emitted elsewhere.
        detok = IncrementalDetokenizer(self.tokenizer, request.all_token_ids, params.skip_special_tokens)
        done = len(request.output_token_ids)
        self.streams[request.request_id] = _Stream(request, detok, num_emitted_tokens=done, num_reported_tokens=done)

    def owns(self, request: Request) -> bool:
        """Whether `request` (this object, not only its id) still has its stream."""
        stream = self.streams.get(request.request_id)
        return stream is not None and stream.request is request

    def remove(self, request: Request) -> None:
        if self.owns(request):
            del self.streams[request.request_id]

    def check_stop_strings(self, request: Request) -> str | None:
        """Detokenize new tokens; return the stop string that now ends the text, if any."""
        stream = self.streams[request.request_id]
        new_ids = request.output_token_ids[stream.num_emitted_tokens :]
        stream.num_emitted_tokens = len(request.output_token_ids)
        if stream.stopped_by is not None or not new_ids:
            return None
        if request.finish_reason is FinishReason.STOP and not isinstance(request.stop_reason, str):
            new_ids = new_ids[:-1]  # the EOS or stop token id that ended it is not part of the text, as in vLLM
        new_text = stream.detokenizer.add(new_ids) if new_ids else ""
        start = max(len(stream.text) - _longest(request.sampling_params.stop) + 1, 0)
        stream.text += new_text
        return self._find_stop(request, stream, start)

    def _find_stop(self, request: Request, stream: _Stream, search_from: int) -> str | None:
        params = request.sampling_params
        if len(request.output_token_ids) < params.min_tokens:
            return None
        for stop in params.stop:
            index = stream.text.find(stop, search_from)
            if index != -1:
                stream.text = stream.text[: index + (len(stop) if params.include_stop_str_in_output else 0)]
                stream.stopped_by = stop
                return stop
        return None

    def emit(self, request: Request) -> RequestOutput:
        """The request's cumulative output, with what is new since the last emit."""
        stream = self.streams[request.request_id]
        new_text = stream.text[stream.num_emitted_chars :]
        stream.num_emitted_chars = len(stream.text)
        new_token_ids = request.output_token_ids[stream.num_reported_tokens :]
        stream.num_reported_tokens = len(request.output_token_ids)
        completion = CompletionOutput(
            token_ids=list(request.output_token_ids),
            text=stream.text,
            logprobs=list(request.logprobs) if request.sampling_params.logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completion,
            new_token_ids=new_token_ids,
            new_text=new_text,
            prompt_logprobs=list(request.prompt_logprobs) if request.wants_prompt_logprobs else None,
            prompt_ranks=list(request.prompt_ranks) if request.wants_prompt_logprobs else None,
            num_cached_tokens=request.num_cached_tokens,
            error=request.error,
            num_logprobs=request.sampling_params.logprobs,
            num_prompt_logprobs=request.sampling_params.prompt_logprobs,
            logprob_token_ids=request.sampling_params.logprob_token_ids,
            queued_s=None if request.scheduled_time is None else request.scheduled_time - request.arrival_time,
            num_preemptions=request.num_preemptions,
        )


def _longest(stops: tuple[str, ...]) -> int:
    return max((len(s) for s in stops), default=1)
