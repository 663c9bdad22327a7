"""HF reference models for tests (the builders live in disagg.bench.hf_baseline), HF folder writing,
and HF `generate` with vLLM's sampling processors: HF's own RepetitionPenaltyLogitsProcessor and
NoBadWordsLogitsProcessor, and a reference LogitsProcessor for allowed ids, logit_bias and the
presence/frequency penalties (HF has none of those in vLLM's form)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor

from disagg.bench.hf_baseline import hf_config, hf_model_from_loaded, save_hf_folder
from disagg.types import SamplingParams

__all__ = ["hf_config", "hf_greedy_processed", "hf_model_from_loaded", "hf_sampled", "save_hf_folder"]


class VllmReference(LogitsProcessor):
    """vLLM's allowed ids, logit bias (stage "before"), presence and frequency penalties (stage
    "after") for a batch of one."""

    def __init__(self, params: SamplingParams, num_prompt: int, stage: str):
        self.params, self.num_prompt, self.stage = params, num_prompt, stage

    def __call__(self, input_ids, scores):
        p, scores = self.params, scores.clone()
        if self.stage == "before":
            if p.allowed_token_ids is not None:
                keep = torch.full_like(scores, float("-inf"))
                keep[:, list(p.allowed_token_ids)] = 0.0
                scores = scores + keep
            for token_id, bias in (p.logit_bias or {}).items():
                scores[:, int(token_id)] += bias
            return scores
        for token_id in input_ids[0, self.num_prompt:].tolist():
            scores[:, token_id] -= p.frequency_penalty
        for token_id in set(input_ids[0, self.num_prompt:].tolist()):
            scores[:, token_id] -= p.presence_penalty
        return scores


def hf_greedy_processed(hf, prompt_ids: list[int], params: SamplingParams, max_new_tokens: int) -> list[int]:
    """HF's greedy output with `params`' penalties, bias, allowed ids and bad words (as token ids)."""
    processors = [VllmReference(params, len(prompt_ids), "before")]
    if params.bad_words_token_ids:
        processors.insert(0, NoBadWordsLogitsProcessor([list(w) for w in params.bad_words_token_ids], eos_token_id=None))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    processors.append(VllmReference(params, len(prompt_ids), "after"))
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                      pad_token_id=0, logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt_ids):].tolist()


def hf_sampled(hf, prompt_ids: list[int], seed: int, temperature: float, max_new_tokens: int) -> list[int]:
    """HF's plain sampling (no top-k/top-p) from the global generator seeded with `seed`: the tokens
    our sampler draws for a request with that seed (one multinomial draw per token, same order)."""
    torch.manual_seed(seed)
    out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                      top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
