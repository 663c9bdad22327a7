"""The engine's frozen configuration: the model (weights, dtype, kernels, quantization), the paged KV
cache and the scheduler, composed into EngineConfig. Read from no environment variable."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from disagg.config import Choice, ConfigError


DTYPES = ("auto", "float32", "bfloat16", "float16")
KERNEL_CHOICES = ("auto", "csrc", "torch")
# none: dense weights in the model dtype; int8/int4: quantize on load; gguf, gguf_float: keep a GGUF's
# own blocks (int8 activations, float32 activations).
QUANTIZATIONS = ("none", "int8", "int4", "gguf", "gguf_float", "auto")
GGUF_BLOCKS = ("gguf", "gguf_float")  # the quantizations that keep a .gguf file's own blocks


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
    quantization: str = field(
        default="auto",
        metadata={"help": "matmul weights: none (dense, the model dtype), int8 (per-channel, quantized on load), "
                          "int4 (group 32, quantized on load), gguf (a .gguf's own Q4_0/Q4_1 as int4, Q8_0 as int8, "
                          "activations rounded to int8 as llama.cpp does), gguf_float (the same blocks, dequantized "
                          "in registers, float32 activations: the dense numbers), "
                          "auto (gguf_float for a .gguf file on CPU, else none); CPU only"},
    )
    device: str = field(default="cpu", metadata={"help": "cpu, cuda (DP rank r takes cuda:r) or cuda:N (every rank)"})
    kernels: str = field(
        default="auto",
        metadata={"help": "forward-pass kernels: auto (csrc/ where built, else torch), csrc, torch"},
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length cap (default: the model's own)"}
    )
    seed: int = field(default=0, metadata={"help": "seed for the tiny model's weights and unseeded sampling"})
    huge_pages: bool = field(
        default=True,
        metadata={"help": "the weights csrc's kernels stream and the KV cache in transparent huge pages on CPU, where "
                          "the kernel gives them (its transparent_hugepage setting always or madvise): a decode step "
                          "reads both; --no-huge-pages: ordinary 4 KB pages"},
    )
    served_model_name: str | None = field(default=None, metadata={"help": "name shown in /v1/models"})
    chat_template: str | None = field(
        default=None,
        metadata={"help": "chat template replacing the model's own: a Jinja file's path, or the template itself "
                          "(vLLM's --chat-template)"},
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.device.startswith("cpu") and self.dtype == "float16":
            raise ConfigError("dtype float16 is not supported on CPU; use bfloat16 or float32")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization not in ("none", "auto") and not self.device.startswith("cpu"):
            raise ConfigError(f"quantization {self.quantization!r} runs on CPU only (torch's int4/int8 CPU kernels); "
                              f"use quantization none on {self.device}")


class KVCacheDType(Choice):
    """What the paged KV cache holds: AUTO the model's dtype; BFLOAT16 half the bytes of a float32
    model's (attention reads half as much; greedy outputs may then differ from HF's)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_dtype: KVCacheDType = field(
        default=KVCacheDType.AUTO,
        metadata={"help": "KV cache dtype: auto (the model's) or bfloat16 (half a float32 model's bytes; "
                          "P and D must agree)"},
    )
    num_blocks: int | None = field(
        default=None, metadata={"help": "KV blocks per worker (default: from kv_cache_memory_mib)"}
    )
    kv_cache_memory_mib: int = field(default=512, metadata={"help": "KV cache size per worker in MiB"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        KVCacheDType.coerce_field(self, "kv_cache_dtype")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be at least 2, got {self.num_blocks}")
        if self.kv_cache_memory_mib <= 0:
            raise ConfigError(f"kv_cache_memory_mib must be positive, got {self.kv_cache_memory_mib}")

    def metrics_info(self, num_blocks: int) -> dict[str, str]:
        """The labels of vLLM's `vllm:cache_config_info` (its CacheConfig.metrics_info: each setting as
        str() writes it) for a worker of `num_blocks` KV blocks; they live in host memory here, which
        vLLM's CPU build reports as num_gpu_blocks too."""
        return {"block_size": str(self.block_size), "cache_dtype": str(self.kv_cache_dtype.value),
                "enable_prefix_caching": str(self.enable_prefix_caching), "num_gpu_blocks": str(num_blocks),
                "num_cpu_blocks": "None", "kv_cache_memory_mib": str(self.kv_cache_memory_mib)}


class SchedulingPolicy(Choice):
    """The order of the engine's waiting queue (vLLM's `--scheduling-policy`)."""

    FCFS = "fcfs"  # arrival order; a request's `priority` has no effect
    PRIORITY = "priority"  # (priority, arrival): lower value first; preemption evicts the largest first


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(
        default=1024, metadata={"help": "token budget of one engine step (chunked prefill)"}
    )
    long_prefill_token_threshold: int = field(
        default=0, metadata={"help": "a request computes at most this many prompt tokens per step (vLLM's flag): "
                                     "long prompts are chunked, so the requests decoding beside them keep their pace "
                                     "(0: up to the step's budget)"})
    max_prefill_tokens_per_step: int = field(
        default=0, metadata={"help": "prompt tokens one step computes over all its requests (as SGLang's "
                                     "--chunked-prefill-size bounds a prefill batch); decoding requests' tokens do not "
                                     "count, so a small value keeps their pace while the step's budget stays large "
                                     "for them (0: the step's budget alone)"})
    scheduling_policy: SchedulingPolicy = field(
        default=SchedulingPolicy.FCFS,
        metadata={"help": "fcfs (arrival order; priority ignored) or priority (a request's priority, lower first, "
                          "then arrival; when the KV cache runs out the running request with the largest "
                          "(priority, arrival) is preempted)"},
    )

    def __post_init__(self) -> None:
        SchedulingPolicy.coerce_field(self, "scheduling_policy")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_prefill_tokens_per_step < 0:
            raise ConfigError(f"max_prefill_tokens_per_step must be >= 0 (0: off), got {self.max_prefill_tokens_per_step}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be >= 0 (0: off), got {self.long_prefill_token_threshold}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = field(default=None, metadata={"help": "torch threads (default: torch's own; a DP worker's controller sets it)"})
    tensor_parallel_size: int = field(default=1, metadata={"help": "processes per DP worker, the model split among them"})

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.cache.kv_cache_dtype == KVCacheDType.BFLOAT16 and self.model.dtype == "float16":
            raise ConfigError("kv_cache_dtype bfloat16 takes a float32 or bfloat16 model, not float16")

    def for_dp_rank(self, rank: int) -> EngineConfig:
        """The config DP worker `rank` runs: each rank its own GPU, so device `cuda` becomes
        `cuda:<rank>`; a device that names its index, or the CPU, is every rank's."""
        if self.model.device != "cuda":
            return self
        return replace(self, model=replace(self.model, device=f"cuda:{rank}"))
