"""The engine config's `auto` values resolved for this device: the model's dtype, the KV cache's
dtype, the forward pass's kernels and the matmul weights' form, each with the reason the ready line
gives for it."""

from __future__ import annotations

from dataclasses import replace

import torch

from disagg.config import ConfigError
from disagg.engine_config import EngineConfig, KVCacheDType, ModelConfig
from disagg.engine.loader import LoadedModel, resolve_model_path, weights_fingerprint
from disagg.ops import csrc_status
from disagg.ops.cpu import cpu_features
from disagg.ops.hugepages import huge_pages_note
from disagg.ops.linear import dtype_name


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """'auto' is bfloat16 where the device computes it natively (AVX512_BF16 or AMX CPUs, as
    disagg.ops.cpu answers under DISAGG_CPU_ISA; Ampere and later GPUs); else float16 on a GPU
    (bfloat16 would be emulated) and float32 on a CPU."""
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if _cuda_has_native_bf16(device) else torch.float16
        return torch.bfloat16 if cpu_features().native_bf16 else torch.float32
    return getattr(torch, name)


def _cuda_has_native_bf16(device: str) -> bool:
    with torch.cuda.device(torch.device(device)):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def dtype_reason(name: str, device: str) -> str:
    """Why `resolve_dtype` chose what it did, for the ready line."""
    if name != "auto":
        return "set by --dtype"
    if device.startswith("cuda"):
        return "auto: native bf16 on this GPU" if _cuda_has_native_bf16(device) else "auto: no native bf16 on this GPU"
    return "auto: native bf16 on this CPU" if cpu_features().native_bf16 else "auto: no native bf16 on this CPU"


def resolve_kv_cache_dtype(kv_cache_dtype: KVCacheDType, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: the model's, or bfloat16 (under a float32 or bfloat16 model: EngineConfig
    refuses it under float16, whose cache would lose precision for no bytes)."""
    if kv_cache_dtype == KVCacheDType.AUTO:
        return model_dtype
    if model_dtype == torch.float16:  # EngineConfig refuses --dtype float16; this is auto's choice on a GPU
        raise ConfigError("kv_cache_dtype bfloat16 takes a float32 or bfloat16 model, not float16 "
                          "(dtype auto chose float16: this GPU has no native bf16)")
    return torch.bfloat16


def cpu_summary() -> str:
    """The ready line's first words: the CPU level in force and what it offers (disagg.ops.cpu)."""
    return f"cpu {cpu_features().describe()}"


def kv_cache_reason(kv_cache_dtype: KVCacheDType) -> str:
    """Why the KV cache holds what it does, for the ready line."""
    return "auto: the model's dtype" if kv_cache_dtype == KVCacheDType.AUTO else "set by --kv-cache-dtype"


def kernels_reason(asked: str, chosen: str) -> str:
    """Why the forward pass runs `chosen` ops, for the ready line."""
    if asked != "auto":
        return "set by --kernels"
    if chosen != "torch":
        return f"auto: csrc built, runs its {chosen.removeprefix('csrc-')} code"
    return f"auto: {csrc_status() or 'csrc runs on the CPU only'}"


def resolve_quantization(model: ModelConfig, tp_size: int = 1) -> tuple[ModelConfig, str | None]:
    """`quantization auto` (the default): a .gguf file's own blocks on CPU with float32 activations
    (`gguf_float`: the dense weights' numbers, where `gguf`'s int8 activations change answers), dense
    (`none`) for anything else and under tensor parallelism (`tp_size` > 1: it splits dense weights);
    the config with the resolved value, and why (for the ready line; None when it was not `auto`)."""
    if model.quantization != "auto":
        return model, None
    is_gguf = model.model != "tiny" and resolve_model_path(model.model).endswith(".gguf")
    if is_gguf and model.device.startswith("cpu") and tp_size == 1:
        return replace(model, quantization="gguf_float"), "auto: a .gguf file, its own blocks on CPU, float32 activations"
    if not is_gguf:
        why = "not a .gguf file"
    elif tp_size > 1:
        why = "tensor parallelism splits dense weights"
    else:
        why = "the GGUF's blocks run on CPU only"
    return replace(model, quantization="none"), f"auto: {why}"


def engine_summary(config: EngineConfig, dtype: torch.dtype, kv_dtype: torch.dtype, model, quantization_reason: str | None,
                   kv_in_huge_pages: bool = False) -> str:
    """For the ready line and /server_info: what runs the model (a built LlamaModel) and why, and what
    went to huge pages (its weights; the KV cache where `kv_in_huge_pages`)."""
    why = dtype_reason(config.model.dtype, config.model.device)
    quantization_note = "" if quantization_reason is None else f" ({quantization_reason})"
    pages = huge_pages_note(config.model.huge_pages, model.device.type == "cpu", model.huge_page_bytes, kv_in_huge_pages)
    return (f"{cpu_summary()}, dtype {dtype_name(dtype)} ({why}), "
            f"kernels {model.ops.name} ({kernels_reason(config.model.kernels, model.ops.name)}), "
            f"quantization {config.model.quantization}{quantization_note}: {model.matmul_weights}, "
            f"kv cache {dtype_name(kv_dtype)} ({kv_cache_reason(config.cache.kv_cache_dtype)}), "
            f"huge pages {pages}")


def compatibility_record(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype,
                         kv_dtype: torch.dtype) -> dict[str, str | int]:
    """What a P/D peer must share with this engine (our router compares it between servers, /server_info's
    `kv_compatibility`): the weights, the compute and KV dtypes, the KV layout; the TP size may differ
    where the heads match."""
    arch = loaded.arch
    return {"model": loaded.name, "weights": weights_fingerprint(config.model), "dtype": dtype_name(dtype),
            "kv_cache_dtype": dtype_name(kv_dtype), "block_size": config.cache.block_size,
            "num_layers": arch.num_layers, "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
            "tp_size": config.tensor_parallel_size}
