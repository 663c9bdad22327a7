"""HF transformers models built from our LoadedModel: the reference the engine is measured and tested against.

transformers is a dev dependency, imported only inside these functions.
"""

from __future__ import annotations

import torch

from disagg.engine.loader import LoadedModel
from disagg.engine.models.arch import LlamaArch


def hf_config(arch: LlamaArch, bos_token_id: int | None = None, eos_token_ids: tuple[int, ...] = ()):
    """The transformers config of `arch`: Qwen3 for qk_norm, Qwen2 for q/k/v biases, else Llama."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    rope = {"rope_type": "default", "rope_theta": arch.rope_theta}
    if arch.rope_scaling is not None:
        factor, low, high, old_len = arch.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": arch.rope_theta, "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": old_len}
    common = dict(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers, num_attention_heads=arch.num_heads, num_key_value_heads=arch.num_kv_heads,
        rms_norm_eps=arch.rms_norm_eps, max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings, rope_parameters=rope,
        bos_token_id=bos_token_id, eos_token_id=list(eos_token_ids) or None,
    )
    assert not (arch.qk_norm and arch.attention_bias), "no HF class has both q/k norms and q/k/v biases"
    if arch.qk_norm:
        return Qwen3Config(head_dim=arch.head_dim, **common)
    if arch.attention_bias:
        config = Qwen2Config(**common)
        config.head_dim = arch.head_dim  # Qwen2Attention reads it when present
        return config
    return LlamaConfig(head_dim=arch.head_dim, **common)


def hf_model_from_loaded(loaded: LoadedModel, dtype: torch.dtype = torch.float32):
    """An HF causal LM with `loaded`'s architecture and weights, in eval mode."""
    from transformers import AutoModelForCausalLM

    tokenizer = loaded.tokenizer
    config = hf_config(loaded.arch, tokenizer.bos_token_id, tokenizer.eos_token_ids)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    tied_head = {"lm_head.weight"} if loaded.arch.tie_word_embeddings else set()
    assert set(missing) <= tied_head and not unexpected, (missing, unexpected)
    if loaded.arch.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def save_hf_folder(loaded: LoadedModel, folder: str, max_shard_size: str | None = None) -> None:
    """Write `loaded` as an HF folder: config.json, *.safetensors, generation_config.json, tokenizer files."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model_from_loaded(loaded).save_pretrained(folder, **kwargs)
    loaded.tokenizer.save(folder)
