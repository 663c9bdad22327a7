"""Logits processors with vLLM's semantics: allowed token ids, bad words, logit bias and penalties.

Applied in vLLM's order (allowed → bad words → logit bias → penalties), before temperature and
truncation; greedy rows take the argmax of what they return. Penalties (vLLM's definitions):
- repetition: every token seen in the prompt or the output has its logit divided by the penalty when
  positive, multiplied by it otherwise;
- frequency: minus penalty × how often the token occurs in the output;
- presence: minus penalty when the token occurs in the output at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disagg.engine.scheduler import ScheduledSeq


def apply_processors(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, dict[int, str]]:
    """`logits` [len(seqs), vocab] with every row's processors applied (a copy when any applies).
    Returns the logits and the rows whose processors raised (with why); those rows are left as they were."""
    rows = [i for i, s in enumerate(seqs) if s.sampling_params.has_processors]
    logits, failed = per_row(logits, rows, lambda i, row: _masks_and_bias(row, seqs[i]))
    penalized = [i for i in rows if i not in failed and seqs[i].sampling_params.has_penalties]
    if penalized:
        logits[penalized] = apply_penalties(logits[penalized], [seqs[i] for i in penalized])
    return logits, failed


def per_row(logits: torch.Tensor, rows: list[int], apply: Callable[[int, torch.Tensor], torch.Tensor]
            ) -> tuple[torch.Tensor, dict[int, str]]:
    """A copy of `logits` whose row i is `apply(i, row)` for each of `rows` (`logits` itself when
    `rows` is empty). A row whose apply raises keeps its values and comes back with why; the
    others go on."""
    failed: dict[int, str] = {}
    if not rows:
        return logits, failed
    logits = logits.clone()
    for i in rows:
        try:
            logits[i] = apply(i, logits[i].clone())
        except Exception as exc:  # noqa: BLE001 - this row only
            failed[i] = f"{type(exc).__name__}: {exc}"
    return logits, failed


def _masks_and_bias(row: torch.Tensor, seq: ScheduledSeq) -> torch.Tensor:
    params = seq.sampling_params
    if params.allowed_token_ids is not None:
        keep = torch.full_like(row, float("-inf"))
        index = torch.tensor(params.allowed_token_ids, dtype=torch.long, device=row.device)
        keep[index] = 0.0
        row = row + keep
    for word in params.bad_words_token_ids:
        if banned_by(word, seq.output_token_ids):
            row[word[-1]] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=row.device)
        row[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row.dtype, device=row.device)
    return row


def banned_by(word: tuple[int, ...], output_token_ids: tuple[int, ...]) -> bool:
    """A bad word's last token is banned when the output ends with the word's other tokens."""
    prefix = word[:-1]
    if len(prefix) > len(output_token_ids):
        return False
    return not prefix or tuple(output_token_ids[-len(prefix):]) == prefix


def apply_penalties(logits: torch.Tensor, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """Repetition, frequency and presence penalties for a batch of rows (one per seq)."""
    num_rows, vocab = logits.shape
    dev = logits.device
    output_counts = _bin_counts([s.output_token_ids for s in seqs], num_rows, vocab).to(dev)
    prompt_seen = _bin_counts([s.prompt_token_ids for s in seqs], num_rows, vocab).to(dev) > 0
    output_seen = output_counts > 0
    params = [s.sampling_params for s in seqs]
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev)[:, None]
    penalties = torch.where(prompt_seen | output_seen, repetition, torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / penalties, logits * penalties)
    return logits - frequency * output_counts - presence * output_seen.to(logits.dtype)


def _bin_counts(token_ids: list[tuple[int, ...]], num_rows: int, vocab: int) -> torch.Tensor:
    counts = torch.zeros(num_rows, vocab)
    for row, ids in enumerate(token_ids):
        if ids:
            counts[row].scatter_add_(0, torch.tensor(ids, dtype=torch.long), torch.ones(len(ids)))
    return counts
