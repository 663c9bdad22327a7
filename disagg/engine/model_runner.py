"""Owns the model weights and the paged KV cache; turns a scheduled step into logits and tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from disagg.engine.models.arch import LlamaArch
from disagg.engine.models.llama import DecodeGroup, ForwardBatch, LlamaModel, PrefillSegment
from disagg.engine.grammar import GrammarCompiler
from disagg.engine.sampler import Sampler, top_logprobs
from disagg.engine.scheduler import SampledToken, ScheduledSeq, SchedulerOutput
from disagg.ops.hugepages import HugePageArena
from disagg.types import TopLogprobs


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TopLogprobs]] = field(default_factory=dict)
    prompt_ranks: dict[str, list[int]] = field(default_factory=dict)  # each actual prompt token's rank
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its part of the step raised

    def merge(self, other: RunnerOutput) -> RunnerOutput:
        self.sampled.update(other.sampled)
        self.prompt_logprobs.update(other.prompt_logprobs)
        self.prompt_ranks.update(other.prompt_ranks)
        self.failed.update(other.failed)
        return self


def kv_bytes_per_block(arch: LlamaArch, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * elem


@dataclass(frozen=True)
class SharedKV:
    """A TP group's KV caches in one file that every rank maps, rank r's after r others: rank 0's
    transfer backend registers the whole group's as one region (kvtransfer/heads.py). Host memory
    only; a new file reads as zeros."""

    path: str
    rank: int
    tp_size: int

    def rank_cache(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        elems = math.prod(shape)
        region = torch.from_file(self.path, shared=True, size=self.tp_size * elems, dtype=dtype)
        return region[self.rank * elems:(self.rank + 1) * elems].view(shape)


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 eos_token_ids: tuple[int, ...], seed: int, grammars: GrammarCompiler | None = None,
                 shared_kv: SharedKV | None = None):
        self.model = model
        self.shared_kv = shared_kv
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_dtype = kv_dtype  # the model's dtype, or bfloat16 under a float32 model
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler(seed, grammars, model.ops.argmax_rows)
        self.kv_cache: torch.Tensor | None = None
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # views of kv_cache, per layer
        self.allocate_kv_cache()

    def allocate_kv_cache(self) -> None:
        arch = self.model.arch
        shape = (self.num_blocks, arch.num_layers, 2, self.block_size, arch.num_kv_heads, arch.head_dim)
        if self.shared_kv is None and self.model.huge_pages:  # a step reads it block by block (ops.hugepages)
            self.kv_cache = HugePageArena().empty(shape, self.kv_dtype)
            self.kv_cache.zero_()  # written now, as torch.zeros writes: the memory is taken at start, not mid-serving
        elif self.shared_kv is None:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.model.device)
        else:
            self.kv_cache = self.shared_kv.rank_cache(shape, self.kv_dtype)
        self.layer_caches = self.model.layer_caches(self.kv_cache)

    def free_kv_cache(self) -> None:
        self.kv_cache = None
        self.layer_caches = []  # views keep the storage alive

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step. A request whose part raises fails alone (in `failed`); the others get
        exactly the tokens they would have got (sampling is per row; KV writes of a re-run are the same).
        On a rank of a tensor-parallel group the step raises instead: re-running halves on one rank
        would break the order of the group's collectives."""
        assert self.kv_cache is not None, "execute while the KV cache is freed"
        return self._isolating(sched.seqs)

    def _isolating(self, seqs: list[ScheduledSeq]) -> RunnerOutput:
        """Run `seqs`; when the forward raises, run halves until the requests that raise alone are found."""
        try:
            return self._run(seqs)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the batch
            if self.model.tp is not None:
                raise  # a rank of a TP group: its ranks' collectives no longer match; the group goes down
            if len(seqs) == 1:
                return RunnerOutput(failed={seqs[0].request_id: f"{type(exc).__name__}: {exc}"})
            mid = len(seqs) // 2
            return self._isolating(seqs[:mid]).merge(self._isolating(seqs[mid:]))

    def _run(self, seqs: list[ScheduledSeq]) -> RunnerOutput:
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        prefills = [s for s in seqs if len(s.token_ids) > 1]
        seqs = decodes + prefills
        batch, sample_rows, prompt_rows = self._build(decodes, prefills)
        logits = self.model.forward(batch, self.kv_cache, self.layer_caches)
        out = RunnerOutput()
        sampling = [s for s in seqs if s.sample]
        if sampling:
            every_row = len(sample_rows) == logits.shape[0]  # rows in order: a decode step, no 3 MB copy
            tokens = self.sampler.sample(logits if every_row else logits[sample_rows], sampling, self.eos_token_ids)
            for seq, token in zip(sampling, tokens):
                if isinstance(token, SampledToken):
                    out.sampled[seq.request_id] = token
                else:
                    out.failed[seq.request_id] = token
        for seq, first, last in prompt_rows:
            try:
                out.prompt_logprobs[seq.request_id], out.prompt_ranks[seq.request_id] = self._prompt_logprobs(
                    seq, logits[first:last])
            except Exception as exc:  # noqa: BLE001 - this request only (sampling already happened)
                out.failed[seq.request_id] = f"{type(exc).__name__}: {exc}"
        return out

    def _build(self, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq]):
        dev = self.model.device
        token_ids, positions, blocks, offsets = [], [], [], []
        logit_rows: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[ScheduledSeq, int, int]] = []
        segments = []
        bs = self.block_size
        for seq in decodes + prefills:
            row = len(token_ids)
            pos = list(range(seq.start_pos, seq.start_pos + len(seq.token_ids)))
            token_ids += seq.token_ids
            positions += pos
            blocks += [seq.block_ids[p // bs] for p in pos]
            offsets += [p % bs for p in pos]
            if len(seq.token_ids) > 1:
                segments.append(PrefillSegment(row, len(token_ids), seq.start_pos, torch.tensor(seq.block_ids, device=dev)))
            if seq.prompt_logprobs:
                # Row p predicts token p + 1; only predictions of prompt tokens are prompt logprobs, and
                # only those not recorded yet (a recompute's chunk may start before where they stop).
                last_row = row + min(len(seq.token_ids), seq.num_prompt_tokens - 1 - seq.start_pos)
                first_row = min(row + seq.prompt_logprobs_from, last_row)
                prompt_rows.append((seq, len(logit_rows), len(logit_rows) + max(last_row - first_row, 0)))
                logit_rows += range(first_row, last_row)
            if seq.sample:
                sample_rows.append(len(logit_rows))
                logit_rows.append(len(token_ids) - 1)
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, device=dev),
            positions=torch.tensor(positions, device=dev),
            slot_blocks=torch.tensor(blocks, device=dev),
            slot_offsets=torch.tensor(offsets, device=dev),
            decode=self._decode_group(decodes) if decodes else None,
            prefills=segments,
            logit_rows=torch.tensor(logit_rows, device=dev, dtype=torch.long),
        )
        return batch, sample_rows, prompt_rows

    def _decode_group(self, decodes: list[ScheduledSeq]) -> DecodeGroup:
        max_blocks = max(len(s.block_ids) for s in decodes)
        table = [s.block_ids + [s.block_ids[0]] * (max_blocks - len(s.block_ids)) for s in decodes]
        dev = self.model.device
        lengths = torch.tensor([s.start_pos + 1 for s in decodes], device=dev)
        return DecodeGroup(len(decodes), torch.tensor(table, device=dev), lengths)

    def _prompt_logprobs(self, seq: ScheduledSeq, logits: torch.Tensor) -> tuple[list[TopLogprobs], list[int]]:
        """Per row, the top-n and the actual next prompt token's logprob; and that token's rank as vLLM
        counts it: the tokens at least as likely, itself included (1: none is likelier)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        num = seq.sampling_params.prompt_logprobs or 0
        actual = (seq.token_ids[1 + seq.prompt_logprobs_from:] + [seq.next_token_id])[: logits.shape[0]]
        extra = seq.sampling_params.logprob_token_ids
        tops = [top_logprobs(logprobs[i], num, tok, extra) for i, tok in enumerate(actual)]
        chosen = logprobs.gather(1, torch.tensor(actual, dtype=torch.long, device=logprobs.device).unsqueeze(1))
        return tops, (logprobs >= chosen).sum(dim=-1).tolist()
