"""Frozen configuration, one dataclass per component, composed per role.

Environment variables are read here and nowhere else. Values found at run time (the model's
architecture, the number of KV blocks that fit) are returned by the component that finds them,
never written back into these objects.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the accepted values."""


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(
        default="smollm2-135m",
        metadata={"help": "model: 'smollm2-135m' (default), 'tiny', an HF folder or a .gguf file"},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "auto (bfloat16 where the CPU supports it, never float16 on CPU), float32, bfloat16"},
    )
    device: str = field(default="cpu", metadata={"help": "cpu or cuda[:N]"})
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length cap (default: the model's own)"}
    )
    seed: int = field(default=0, metadata={"help": "seed for the tiny model's weights and unseeded sampling"})
    served_model_name: str | None = field(default=None, metadata={"help": "name shown in /v1/models"})

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device.startswith("cpu") and self.dtype == "float16":
            raise ConfigError("dtype float16 is not supported on CPU; use bfloat16 or float32")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    num_blocks: int | None = field(
        default=None, metadata={"help": "KV blocks per worker (default: from kv_cache_memory_mib)"}
    )
    kv_cache_memory_mib: int = field(default=512, metadata={"help": "KV cache size per worker in MiB"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be at least 2, got {self.num_blocks}")
        if self.kv_cache_memory_mib <= 0:
            raise ConfigError(f"kv_cache_memory_mib must be positive, got {self.kv_cache_memory_mib}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(
        default=1024, metadata={"help": "token budget of one engine step (chunked prefill)"}
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = field(default=None, metadata={"help": "torch threads (default: all cores)"})


def replace(obj, **changes):
    """dataclasses.replace, re-exported so callers need one import for config work."""
    return dataclasses.replace(obj, **changes)


def env_flag(name: str, environ: dict[str, str] | None = None) -> bool:
    """True when the environment variable is set to 1/true/yes/on (case-insensitive)."""
    value = (environ if environ is not None else os.environ).get(name, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def force_query_prefill_dp_rank(environ: dict[str, str] | None = None) -> bool:
    """DISAGG_FORCE_QUERY_PREFILL_DP_RANK: decode always asks the registry for the prefill DP rank."""
    return env_flag("DISAGG_FORCE_QUERY_PREFILL_DP_RANK", environ)
