"""The architecture values of a Llama-family model, found when the model is loaded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Llama 3.x "llama3" RoPE scaling as (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None for plain RoPE.
    rope_scaling: tuple[float, float, float, int] | None = None
    # Qwen2 has biases on q/k/v projections; Qwen3 normalizes q and k per head.
    attention_bias: bool = False
    qk_norm: bool = False
