"""Beam search as vLLM's OpenAI server runs it (`use_beam_search`): the policy alone, no I/O.

Each step asks every live beam's next token for its top `2 x width` logprobs (the engine's raw
logprobs: temperature does not change them, as in vLLM). Every (beam, token) pair is a candidate
with the beam's cumulative logprob plus the token's. A candidate that is an EOS token (unless
`ignore_eos`) ends as a finished beam; the others compete for the `width` live places, best
cumulative logprob first. After `max_tokens` steps, or once no beam is live, the live and finished
beams are ranked by `cum_logprob / length ** length_penalty`, where the length counts the prompt
and not a final EOS (vLLM's and HF's score), and the best `width` are the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TopTokens = tuple[tuple[int, float], ...]  # one step's most likely next tokens, best first


@dataclass(frozen=True)
class BeamParams:
    """What a beam search takes from a request (vLLM's BeamSearchParams)."""

    width: int  # the request's `n`: beams kept and answered
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # a beam ended by EOS keeps that token in its token ids

    @property
    def num_logprobs(self) -> int:
        """Candidates asked of each beam a step."""
        return 2 * self.width


@dataclass(frozen=True)
class Beam:
    """One hypothesis: its generated tokens (the prompt excluded) and, per token, that step's top tokens."""

    token_ids: tuple[int, ...] = ()
    cum_logprob: float = 0.0
    steps: tuple[TopTokens, ...] = ()
    finish_reason: str | None = None  # "stop" when an EOS ended it; None: it ran out of steps ("length")
    stop_reason: int | None = None  # the EOS token that ended it


class BeamSearch:
    """The beams of one prompt. Feed `step()` each live beam's top tokens until `done`, then read `best()`."""

    def __init__(self, params: BeamParams, num_prompt_tokens: int, eos_token_ids: Sequence[int]):
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.live: list[Beam] = [Beam()]
        self.finished: list[Beam] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.num_steps >= self.params.max_tokens

    def step(self, tops: Sequence[TopTokens]) -> None:
        """Extend the live beams by one token; `tops[i]` holds live beam i's top next tokens (its first
        `2 x width` are the candidates; the beam keeps the whole list, for the answer's logprobs)."""
        assert len(tops) == len(self.live), "one top list per live beam"
        params, candidates = self.params, []
        for beam, top in zip(self.live, tops):
            for token_id, logprob in top[:params.num_logprobs]:
                cum_logprob = beam.cum_logprob + logprob
                if token_id in self.eos_token_ids and not params.ignore_eos:
                    kept = (token_id,) if params.include_stop_str_in_output else ()
                    self.finished.append(Beam(beam.token_ids + kept, cum_logprob, beam.steps + (top,), "stop", token_id))
                else:
                    candidates.append((cum_logprob, token_id, beam, top))
        candidates.sort(key=lambda c: -c[0])  # stable: equal scores keep beam order, then rank order
        self.live = [Beam(beam.token_ids + (token_id,), cum_logprob, beam.steps + (top,))
                     for cum_logprob, token_id, beam, top in candidates[:params.width]]
        self.num_steps += 1

    def score(self, beam: Beam) -> float:
        """vLLM's beam score: the cumulative logprob over the length (prompt included, a final EOS not)
        to the power `length_penalty`."""
        length = self.num_prompt_tokens + len(beam.token_ids)
        if beam.token_ids and beam.token_ids[-1] in self.eos_token_ids:
            length -= 1
        return beam.cum_logprob / (max(length, 1) ** self.params.length_penalty)

    def best(self) -> list[Beam]:
        """The answer: the `width` best of every finished and live beam, best first."""
        return sorted(self.finished + self.live, key=self.score, reverse=True)[:self.params.width]
