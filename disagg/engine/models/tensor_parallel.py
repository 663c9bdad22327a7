"""Tensor parallelism, the engine's part: Megatron's split of a Llama layer across `size` ranks, and
the collectives its forward pass needs.

- q, k, v by heads (columns of the fused QKV), each rank its `num_heads / size` query heads and the
  KV heads they read: `num_kv_heads / size` of them, or, with more ranks than KV heads, the one KV
  head its query heads share (replicated on `size / num_kv_heads` ranks, as vLLM does);
- o_proj by its input columns (the rank's heads), then an all-reduce;
- gate and up by rows, down by its input columns, then an all-reduce;
- the LM head by vocabulary rows, its logits gathered: every rank samples from the same full
  logits, so ranks that run the same requests take the same tokens. The embedding stays whole.

Each rank's KV cache holds only its KV heads (`shard_arch`). Dense weights only: a GGUF's own
quantized blocks are not split (ConfigError).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from disagg.config import ConfigError
from disagg.engine.models.arch import LlamaArch


class Collectives(Protocol):
    """What a tensor-parallel forward pass needs from its group."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place; returns `x`."""

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dimension, in rank order."""


class TorchCollectives:
    """torch.distributed's default group (gloo on CPU, NCCL on CUDA), every call bounded by the
    group's timeout: a rank that died fails its peers' next collective instead of hanging them."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def init_group(rank: int, size: int, init_method: str, device: str = "cpu", timeout_s: float = 60.0) -> TorchCollectives:
    """Join the TP group (`init_method`: a `tcp://` or `file://` rendezvous) and return its
    collectives: NCCL for a model on CUDA, gloo on the CPU."""
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TorchCollectives()


@dataclass(frozen=True)
class HeadSplit:
    """Which heads one rank holds: query heads [q_start, q_end), KV heads [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int


def check_split(arch: LlamaArch, size: int) -> None:
    """ConfigError unless `arch` splits evenly over `size` ranks."""
    problems = [f"{name} {value} is not a multiple of {size}" for name, value in
                (("num_heads", arch.num_heads), ("intermediate_size", arch.intermediate_size),
                 ("vocab_size", arch.vocab_size)) if value % size]
    kv = arch.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"num_kv_heads {kv} neither divides nor is divided by {size}")
    if problems:
        raise ConfigError(f"tensor_parallel_size {size} does not fit this model: {'; '.join(problems)}")


def head_split(arch: LlamaArch, rank: int, size: int) -> HeadSplit:
    per_q = arch.num_heads // size
    if arch.num_kv_heads >= size:
        per_kv = arch.num_kv_heads // size
        return HeadSplit(rank * per_q, (rank + 1) * per_q, rank * per_kv, (rank + 1) * per_kv)
    kv = rank // (size // arch.num_kv_heads)  # the KV head this rank's query heads read, replicated
    return HeadSplit(rank * per_q, (rank + 1) * per_q, kv, kv + 1)


def shard_arch(arch: LlamaArch, rank: int, size: int) -> LlamaArch:
    """The per-rank shapes: its heads, its share of the MLP (the vocabulary stays whole: logits are gathered)."""
    split = head_split(arch, rank, size)
    return replace(arch, num_heads=split.q_end - split.q_start, num_kv_heads=split.kv_end - split.kv_start,
                   intermediate_size=arch.intermediate_size // size)


def shard_weights(weights: Mapping[str, torch.Tensor], arch: LlamaArch, rank: int,
                  size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s weights under HF Llama names (the LM head's rows as `lm_head.weight`, tied or not)."""
    check_split(arch, size)
    split, hd = head_split(arch, rank, size), arch.head_dim
    q_rows, kv_rows = slice(split.q_start * hd, split.q_end * hd), slice(split.kv_start * hd, split.kv_end * hd)
    inter = arch.intermediate_size // size
    mlp_rows = slice(rank * inter, (rank + 1) * inter)
    vocab = arch.vocab_size // size
    out = dict(weights)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    out["lm_head.weight"] = head[rank * vocab:(rank + 1) * vocab]
    for i in range(arch.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            out[a + name + ".weight"] = weights[a + name + ".weight"][rows]
            if a + name + ".bias" in weights:
                out[a + name + ".bias"] = weights[a + name + ".bias"][rows]
        out[a + "o_proj.weight"] = weights[a + "o_proj.weight"][:, q_rows]
        out[m + "gate_proj.weight"] = weights[m + "gate_proj.weight"][mlp_rows]
        out[m + "up_proj.weight"] = weights[m + "up_proj.weight"][mlp_rows]
        out[m + "down_proj.weight"] = weights[m + "down_proj.weight"][:, mlp_rows]
    return {name: t.contiguous() for name, t in out.items()}
