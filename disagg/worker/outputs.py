"""A worker's answers: engine outputs and errors as the OutputMsgs the front forwards. Every role uses them."""

from __future__ import annotations

import structlog

from disagg.types import EngineSleeping, FinishReason, InvalidRequest, RequestOutput
from disagg.wire.engine_msgs import OutputMsg

log = structlog.get_logger(__name__)


def error_output(request_id: str, exc: Exception) -> OutputMsg:
    status = 400 if isinstance(exc, InvalidRequest) else 503 if isinstance(exc, EngineSleeping) else 500
    param, code = getattr(exc, "param", None), getattr(exc, "code", None)
    return OutputMsg(request_id, finish_reason=FinishReason.ABORT, error=str(exc), error_status=status, error_param=param,
                     error_code=code)


def admission_error(request_id: str, exc: Exception) -> OutputMsg:
    """The answer to a request that could not be admitted: 400/503 for the typed errors; anything
    else is our bug, logged with its traceback and answered 500 with the exception's text."""
    if isinstance(exc, (InvalidRequest, EngineSleeping)):
        return error_output(request_id, exc)
    log.exception("could not admit the request", request_id=request_id)
    return error_output(request_id, RuntimeError(f"the worker could not admit the request: {type(exc).__name__}: {exc}"))


def logprob_pairs(top: dict[int, float], sampled: int, num_top: int, extra_ids: tuple[int, ...] = ()) -> list[tuple[int, float]]:
    """The sampled (or actual) token first, then the top `num_top` by descending logprob, which
    include that token again when it ranks among them (as OpenAI's top_logprobs do), then the
    `extra_ids` asked for by id. The top-n of `top` are its `num_top` largest: it holds them all."""
    ranked = sorted(top.items(), key=lambda p: -p[1])[:num_top]
    return [(sampled, top[sampled])] + ranked + [(t, top[t]) for t in extra_ids]


def to_output_msg(out: RequestOutput, first: bool) -> OutputMsg:
    new = out.new_token_ids
    logprobs = None
    if out.outputs.logprobs is not None and new:
        tops = out.outputs.logprobs[len(out.outputs.logprobs) - len(new) :]
        logprobs = [logprob_pairs(top, tok, out.num_logprobs or 0, out.logprob_token_ids) for top, tok in zip(tops, new)]
    prompt_logprobs = prompt_ranks = None
    if first and out.prompt_logprobs is not None:
        prompt_logprobs = [
            None if top is None else logprob_pairs(top, tok, out.num_prompt_logprobs or 0, out.logprob_token_ids)
            for top, tok in zip(out.prompt_logprobs, out.prompt_token_ids)
        ]
        prompt_ranks = out.prompt_ranks
    return OutputMsg(
        request_id=out.request_id, new_token_ids=list(new), new_text=out.new_text,
        finish_reason=out.outputs.finish_reason, stop_reason=out.outputs.stop_reason,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs, prompt_ranks=prompt_ranks,
        num_prompt_tokens=len(out.prompt_token_ids),
        num_cached_tokens=out.num_cached_tokens, num_output_tokens=len(out.outputs.token_ids),
        **({"queued_s": out.queued_s, "num_preemptions": out.num_preemptions} if out.finished else {}),
    )
