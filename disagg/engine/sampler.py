"""Turns logits into tokens: logits processors (logits_processors.py), min_tokens, greedy,
temperature, top-k, top-p, min-p, seeds, logprobs.

Logprobs are those of the model's raw distribution (before temperature and truncation), as vLLM
returns by default. `temperature == 0` is greedy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disagg.engine.grammar import GrammarCompiler, GrammarMatcher
from disagg.engine.logits_processors import apply_processors, per_row
from disagg.engine.scheduler import SampledToken, ScheduledSeq
from disagg.ops.reference import TorchOps
from disagg.types import SamplingParams, TopLogprobs

ArgmaxRows = Callable[[torch.Tensor], torch.Tensor]


def top_logprobs(logprobs: torch.Tensor, num: int, token_id: int, extra_ids: tuple[int, ...] = ()) -> TopLogprobs:
    """The `num` most likely tokens' logprobs, plus `token_id`'s (the chosen or actual token) and
    those of `extra_ids` (SGLang's token_ids_logprob)."""
    out: TopLogprobs = {}
    if num > 0:
        values, ids = logprobs.topk(num)
        out = dict(zip(ids.tolist(), values.tolist()))
    for extra in extra_ids:
        out[extra] = float(logprobs[extra])
    out[token_id] = float(logprobs[token_id])
    return out


class Sampler:
    """`argmax_rows` picks the greedy tokens (the model's ops pass csrc's, ~10x torch's on a CPU)."""

    def __init__(self, seed: int = 0, grammars: GrammarCompiler | None = None,
                 argmax_rows: ArgmaxRows = TorchOps.argmax_rows):
        self.argmax_rows = argmax_rows
        self.generator = torch.Generator().manual_seed(seed)
        self.seeded: dict[str, torch.Generator] = {}
        self.grammars = grammars
        self.matchers: dict[str, GrammarMatcher] = {}

    def forget(self, request_id: str) -> None:
        self.seeded.pop(request_id, None)
        self.matchers.pop(request_id, None)

    def sample(self, logits: torch.Tensor, seqs: list[ScheduledSeq], eos_token_ids: tuple[int, ...]) -> list[SampledToken | str]:
        """One token per row of `logits` ([len(seqs), vocab], float32); a row whose sampling raises
        gets the reason instead, and the other rows are sampled exactly as without it."""
        raw = logits
        logits, failed = self._mask_grammars(logits, seqs)
        logits, more_failed = apply_processors(logits, seqs)
        failed = more_failed | failed
        logits, more_failed = self._mask_early_stops(logits, seqs, eos_token_ids)
        failed = more_failed | failed
        token_ids = self.argmax_rows(logits).tolist()
        for i, seq in enumerate(seqs):
            if i not in failed and not seq.sampling_params.greedy:
                try:
                    token_ids[i] = self._sample_row(logits[i], seq)
                except Exception as exc:  # noqa: BLE001 - this row only
                    failed[i] = f"{type(exc).__name__}: {exc}"
        want = [i for i, s in enumerate(seqs) if s.sampling_params.logprobs is not None and i not in failed]
        logprobs = torch.log_softmax(raw[want], dim=-1) if want else None
        out: list[SampledToken | str] = []
        for i, seq in enumerate(seqs):
            if i in failed:
                out.append(failed[i])
                continue
            top = None
            if logprobs is not None and seq.sampling_params.logprobs is not None:
                params = seq.sampling_params
                top = top_logprobs(logprobs[want.index(i)], params.logprobs, token_ids[i], params.logprob_token_ids)
            out.append(SampledToken(token_ids[i], top))
        return out

    def _mask_grammars(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, dict[int, str]]:
        """Only the tokens each structured request's grammar allows next (the matcher first consumes
        the output tokens it has not seen). Returns the masked logits and the rows that failed."""
        rows = [i for i, s in enumerate(seqs) if s.sampling_params.structured_output is not None]
        return per_row(logits, rows, lambda i, row: self._grammar_row(row, seqs[i]))

    def _grammar_row(self, row: torch.Tensor, seq: ScheduledSeq) -> torch.Tensor:
        allowed = self._matcher(seq).allowed()
        if not allowed.any():
            raise RuntimeError("the grammar allows no token here")
        return row.masked_fill_(~allowed.to(row.device), float("-inf"))

    def _matcher(self, seq: ScheduledSeq) -> GrammarMatcher:
        matcher = self.matchers.get(seq.request_id)
        if matcher is None:
            if self.grammars is None:
                raise RuntimeError("this engine has no grammar compiler")
            matcher = self.matchers[seq.request_id] = self.grammars.matcher(seq.sampling_params.structured_output)
        matcher.sync(seq.output_token_ids)
        return matcher

    def _mask_early_stops(self, logits, seqs: list[ScheduledSeq], eos_token_ids) -> tuple[torch.Tensor, dict[int, str]]:
        """Before min_tokens are out, EOS and stop token ids cannot be sampled. Returns the masked
        logits and the rows whose mask could not be applied (with why)."""
        rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.sampling_params.min_tokens]
        failed: dict[int, str] = {}
        if not rows:
            return logits, failed
        logits = logits.clone()
        for i in rows:
            params = seqs[i].sampling_params
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
            try:
                logits[i, banned] = float("-inf")
            except Exception as exc:  # noqa: BLE001 - e.g. a stop token id past the vocabulary
                failed[i] = f"{type(exc).__name__}: {exc}"
        return logits, failed

    def _sample_row(self, logits: torch.Tensor, seq: ScheduledSeq) -> int:
        # On the CPU, whatever the model's device: the generators are CPU ones (a CUDA tensor refuses
        # them), so a seed draws the same tokens from the same logits on either device.
        probs = truncated_probs(logits.cpu(), seq.sampling_params)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq)).item())

    def _generator(self, seq: ScheduledSeq) -> torch.Generator:
        seed = seq.sampling_params.seed
        return self.generator if seed is None else self._seeded(seq.request_id, seed)

    def _seeded(self, request_id: str, seed: int) -> torch.Generator:
        gen = self.seeded.get(request_id)
        if gen is None:
            gen = self.seeded[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def skip_draw(self, request_id: str, seed: int, vocab_size: int) -> None:
        """Advance a seeded request's generator past one token drawn elsewhere (another engine
        sampled it from the same seed), so the next tokens are the ones one engine would draw.
        A draw consumes the same random numbers whatever the probabilities; only the size counts."""
        torch.multinomial(torch.ones(vocab_size), 1, generator=self._seeded(request_id, seed))


def truncated_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (one row)."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p. The first token always stays, even when
        # top_p rounds to 0 in float32 (a subnormal top_p would otherwise drop every token: NaN).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()
