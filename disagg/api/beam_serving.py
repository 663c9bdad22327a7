"""`use_beam_search` on /v1/completions and /v1/chat/completions, as vLLM's OpenAI server offers it:
the front runs the search (disagg/api/beams.py), one engine request per live beam and step, all on
the DP worker that took the request.

Step 0 is the request itself, P/D fields and all, asking for one token and its top 2 x n logprobs:
a prefill answers just that (the router reads nothing of it), and a decode gets that token's
logprobs with the prompt's KV, as for any request. Each later step runs every live beam as a request
whose prompt is the prompt's token ids and whose `resume_token_ids` are the beam's tokens (a
migrated request's shape: computed on this worker, only the next token emitted). The prefix cache
holds the prompt's and the beams' common blocks, so a step computes little more than each beam's
last block; on a decode the prompt's blocks are the ones the prefill wrote. The answered beams'
texts are detokenized by the worker. The answer comes whole (a stream sends it at the end, as vLLM's
does): one choice per beam, best first.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import msgspec
from aiohttp import web

from disagg.api.batch import all_or_first_error
from disagg.api.beams import Beam, BeamParams, BeamSearch, TopTokens
from disagg.api.errors import to_api_error
from disagg.api.generation import Generation, Totals
from disagg.api.logging import bind_request
from disagg.api.parallel import indexed
from disagg.api.serving import Renderer, admit, json_response, shutdown_if_drained
from disagg.api.sse import ClientGone, SSEWriter
from disagg.api.state import ApiState, state_of
from disagg.config import DisaggregationMode
from disagg.http_edge import BadRequest
from disagg.types import MAX_LOGPROBS, FinishReason, SamplingParams
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg, Utility
from disagg.wire.headers import DP_RANK_HEADER, REQUEST_ID_HEADER

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam asks for 2 x n logprobs a step
# What a beam search takes from the sampling fields; any other set to a non-default value is refused.
BEAM_FIELDS = frozenset({"max_tokens", "default_max_tokens", "temperature", "ignore_eos", "include_stop_str_in_output",
                         "logprobs", "skip_special_tokens", "truncate_prompt_tokens", "truncation_side"})
_BODY_NAMES = {"structured_output": "response_format", "bad_words_token_ids": "bad_words"}
_DEFAULTS = SamplingParams()


def check_beam_request(sampling: SamplingParams, n: int | None) -> int:
    """The beam width (`n`, default 1) once the request is one a beam search can honour: every
    sampling field it cannot apply is at its default (else a 400 naming the field)."""
    width = 1 if n is None else n
    if not 1 <= width <= MAX_BEAM_WIDTH:
        raise BadRequest(f"use_beam_search takes n (the beam width) between 1 and {MAX_BEAM_WIDTH}, got {width}: "
                         f"each beam asks for 2 x n logprobs a step, at most {MAX_LOGPROBS}", "n")
    for field in dataclasses.fields(SamplingParams):
        if field.name not in BEAM_FIELDS and getattr(sampling, field.name) != getattr(_DEFAULTS, field.name):
            name = _BODY_NAMES.get(field.name, field.name)
            raise BadRequest(f"{name} does not apply to beam search: use_beam_search takes n, max_tokens, "
                             "length_penalty, ignore_eos, include_stop_str_in_output, temperature and logprobs", name)
    return width


def step_sampling(sampling: SamplingParams, width: int, num_resumed: int = 0) -> SamplingParams:
    """One step of one beam: the next token (after the `num_resumed` the beam has) and its top 2 x width
    (more when the request's `logprobs` asks for more)."""
    return SamplingParams(max_tokens=num_resumed + 1, temperature=0.0, logprobs=max(2 * width, sampling.logprobs or 0),
                          truncate_prompt_tokens=None if num_resumed else sampling.truncate_prompt_tokens,
                          truncation_side=sampling.truncation_side)


def beam_first_step(msg: GenerateMsg, width: int) -> GenerateMsg:
    """Step 0 of `msg`'s search: what a prefill computes (and hands the decode with the KV)."""
    return msgspec.structs.replace(msg, sampling=step_sampling(msg.sampling, width))


def resolve_max_tokens(sampling: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """The beams' length: `max_tokens` as the engine checks it, else the endpoint's default, capped by the context."""
    room = max_model_len - num_prompt_tokens
    if sampling.max_tokens is None:
        return room if sampling.default_max_tokens is None else min(sampling.default_max_tokens, room)
    if sampling.max_tokens > room:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + sampling.max_tokens} tokens ({num_prompt_tokens} in the messages, "
            f"{sampling.max_tokens} in the completion). Please reduce the length of the messages or completion.",
            "max_tokens")
    return sampling.max_tokens


def _top(totals: Totals) -> TopTokens:
    """A step's top tokens: its one token's logprob entry past the sampled token."""
    return tuple(totals.logprobs[-1][1:])


class _Search:
    """One prompt's search on one DP worker."""

    def __init__(self, state: ApiState, msg: GenerateMsg, dp_rank: int, width: int, length_penalty: float):
        self.state, self.msg, self.dp_rank = state, msg, dp_rank
        self.sampling, self.width, self.length_penalty = msg.sampling, width, length_penalty
        self.token_texts: dict[int, str] = {}

    async def run(self) -> list[tuple[OutputMsg, Totals]]:
        [first] = await self._run([msgspec.structs.replace(beam_first_step(self.msg, self.width), return_prompt=True)])
        prompt_ids = first.prompt_token_ids
        sampling = self.sampling
        params = BeamParams(self.width, resolve_max_tokens(sampling, len(prompt_ids), self.state.engine.model.max_model_len),
                            self.length_penalty, sampling.ignore_eos, sampling.include_stop_str_in_output)
        search = BeamSearch(params, len(prompt_ids), self.state.engine.model.eos_token_ids)
        if not search.done:
            search.step([_top(first)])
        while not search.done:
            steps = await self._run([self._beam_msg(prompt_ids, beam, search.num_steps, i)
                                     for i, beam in enumerate(search.live)])
            search.step([_top(t) for t in steps])
        beams = search.best()
        texts = await asyncio.gather(*(self._text(search, beam) for beam in beams))
        return [self._answer(first, beam, text) for beam, text in zip(beams, texts)]

    async def _run(self, msgs: list[GenerateMsg]) -> list[Totals]:
        steps = [Generation(self.state, m, self.dp_rank, times_first_token=False) for m in msgs]
        totals = await all_or_first_error([asyncio.create_task(step.collect()) for step in steps])
        for t in totals:
            self.token_texts.update(t.token_texts)
        return totals

    def _beam_msg(self, prompt_ids: list[int], beam: Beam, step: int, index: int) -> GenerateMsg:
        return GenerateMsg(f"{self.msg.request_id}-beam{step}-{index}", step_sampling(self.sampling, self.width,
                                                                                    len(beam.token_ids)),
                           prompt_token_ids=prompt_ids, resume_token_ids=list(beam.token_ids),
                           return_token_texts=self.msg.return_token_texts, priority=self.msg.priority)

    async def _text(self, search: BeamSearch, beam: Beam) -> str:
        """The beam's text, without the EOS that ended it (vLLM's)."""
        ids = list(beam.token_ids)
        if ids and ids[-1] in search.eos_token_ids and not search.params.ignore_eos:
            ids = ids[:-1]
        if not ids:
            return ""
        [text] = await self.state.engine.call_utility(Utility.DETOKENIZE, ids, self.sampling.skip_special_tokens,
                                                      ranks=[self.dp_rank])
        return text

    def _answer(self, first: Totals, beam: Beam, text: str) -> tuple[OutputMsg, Totals]:
        """The beam as one whole output, and its totals (the prompt's counts and KV from step 0)."""
        num_top = self.sampling.logprobs
        logprobs = None if num_top is None else [
            [(t, dict(top)[t]), *top[:num_top]] for t, top in zip(beam.token_ids, beam.steps)]
        out = OutputMsg(self.msg.request_id, new_token_ids=list(beam.token_ids), new_text=text,
                        finish_reason=FinishReason.STOP if beam.finish_reason else FinishReason.LENGTH,
                        stop_reason=beam.stop_reason, logprobs=logprobs, num_prompt_tokens=first.num_prompt_tokens,
                        num_cached_tokens=first.num_cached_tokens, num_output_tokens=len(beam.token_ids),
                        prompt_token_ids=first.prompt_token_ids if self.msg.return_prompt else None,
                        prompt_text=first.prompt_text if self.msg.return_prompt else None,
                        token_texts=self.token_texts or None, kv=first.kv)
        totals = Totals(self.msg.request_id, self.dp_rank, first.created)
        totals.add(out)
        return out, totals


def _merged(request_id: str, per_prompt: list[list[Totals]]) -> Totals:
    """Totals whose usage counts each prompt once and every beam's tokens."""
    first = per_prompt[0][0]
    merged = Totals(request_id, first.dp_rank, first.created,
                    num_prompt_tokens=sum(beams[0].num_prompt_tokens for beams in per_prompt),
                    num_cached_tokens=sum(beams[0].num_cached_tokens for beams in per_prompt))
    merged.token_ids = [t for beams in per_prompt for b in beams for t in b.token_ids]
    return merged


async def serve_beam_search(request: web.Request, msgs: list[GenerateMsg], routed_dp_rank: int | None,
                            new_renderer: Callable[[int], Renderer], *, request_id: str, width: int,
                            length_penalty: float, stream: bool) -> web.StreamResponse:
    """Answer a beam search of one prompt or a batch (each prompt's search at once, each on the worker
    its room picks): choice `p * width + i` is prompt p's i-th best beam; `new_renderer(p)` shapes
    prompt p's choices. A prefill runs step 0 only, through the endpoint's usual path."""
    state = state_of(request)
    assert state.engine.mode is not DisaggregationMode.PREFILL, "a prefill answers step 0 only"
    bind_request(request_id, bootstrap_room=msgs[0].bootstrap_room)
    admit(state, request.headers)
    with state.drain.track():
        ranks = [state.engine.pick_rank(routed_dp_rank, m.bootstrap_room, m) for m in msgs]
        for rank in ranks:
            state.metrics.vllm.observe_n(rank, width)
        headers = {DP_RANK_HEADER: str(ranks[0]), REQUEST_ID_HEADER: request_id}
        searches = [_Search(state, m, r, width, length_penalty).run() for m, r in zip(msgs, ranks)]
        with shutdown_if_drained(state.drain):
            per_prompt = await all_or_first_error([asyncio.create_task(s) for s in searches])
        choices = [(new_renderer(p), out, t) for p, answers in enumerate(per_prompt) for out, t in answers]
        merged = _merged(request_id, [[t for _, t in answers] for answers in per_prompt])
        if not stream:
            body = dict(choices[0][0].full(choices[0][2]))
            body["id" if "id" in body else "request_id"] = request_id
            body["choices"] = [{**r.full(t)["choices"][0], "index": i} for i, (r, _, t) in enumerate(choices)]
            body["usage"] = merged.usage()
            return json_response(body, headers=headers)
        sse = SSEWriter(headers)
        await sse.start(request)
        try:
            for i, (renderer, out, t) in enumerate(choices):
                await sse.send_all([indexed(c, i, request_id) for c in renderer.chunks(out, t)])
            await sse.send_all(choices[0][0].tail(merged))
            await sse.done()
        except ClientGone:
            pass
        except Exception as exc:  # noqa: BLE001 - a renderer failed mid-stream: one error event
            await sse.send_error(to_api_error(exc))
        return sse.response
