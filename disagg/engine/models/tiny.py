"""The tiny test model: a seeded random-weight Llama with a byte-level tokenizer, built in code.

Small enough for microsecond-scale CPU tests, yet every Llama feature the engine must get right is
exercised: GQA (4 query heads share 2 KV heads), an untied LM head, BOS, a ChatML chat template.
Weights are drawn wide enough (std 0.2 on projections) that greedy continuations differ between
prompts instead of collapsing to one repeated token.
"""

from __future__ import annotations

import tokenizers
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from disagg.engine.loader import LoadedModel, check_weights, weight_shapes
from disagg.engine.models.arch import LlamaArch
from disagg.engine.tokenizer import Tokenizer, bos_eos_processor, bytes_to_unicode

NUM_BYTE_TOKENS = 256
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = 256, 257, 258, 259
SPECIAL_TOKENS = ("<bos>", "<eos>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 320  # 256 bytes, 4 named specials, reserved specials up to a multiple of 64

TINY_ARCH = LlamaArch(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_PROJECTION_STD = 0.2
_EMBEDDING_STD = 1.0
_NORM_STD = 0.1  # norms are 1 + noise, so a runner that ignores a norm weight fails the HF comparison


def build_tiny(seed: int = 0) -> LoadedModel:
    """The tiny model with weights drawn from `seed` (the same on every run and machine)."""
    return LoadedModel("tiny", TINY_ARCH, random_weights(TINY_ARCH, seed), build_tiny_tokenizer())


def random_weights(arch: LlamaArch, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for any (small) `arch`, drawn as the tiny model's are."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(arch).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + _NORM_STD * noise
        elif name == "model.embed_tokens.weight":
            weights[name] = _EMBEDDING_STD * noise
        else:
            weights[name] = _PROJECTION_STD * noise
    check_weights(weights, arch, "random weights")
    return weights


def build_tiny_tokenizer() -> Tokenizer:
    """Byte-level: token i < 256 is byte i; then <bos>, <eos>, <|im_start|>, <|im_end|>, reserved.

    BOS is added by `encode`; generation ends at <eos> or <|im_end|>.
    """
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(NUM_BYTE_TOKENS)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges every byte is its own token anyway.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - NUM_BYTE_TOKENS - len(SPECIAL_TOKENS))]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (*SPECIAL_TOKENS, *reserved)])
    assert backend.token_to_id("<bos>") == BOS_ID and backend.get_vocab_size() == VOCAB_SIZE, "tiny vocab layout"
    backend.post_processor = bos_eos_processor(backend, BOS_ID, None)
    return Tokenizer(backend, BOS_ID, (EOS_ID, IM_END_ID), CHAT_TEMPLATE)
