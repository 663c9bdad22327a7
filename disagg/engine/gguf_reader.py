"""Reading a GGUF file: metadata, architecture, float32 weights under HF names, and the vocabulary.

Numpy and the `gguf` package only (the tokenizer imports this module and stays torch-free); the
loader turns the arrays into tensors. `read_weights` dequantizes tensors to float32; `read_blocks`
returns the Q4_0/Q4_1/Q8_0 weights' blocks as stored, for `--quantization gguf`.

llama.cpp's converter permutes the rows of attn_q/attn_k of "llama" models so that RoPE can rotate
adjacent pairs; HF (and our engine) rotate halves, so `read_weights` undoes that permutation.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import tokenizers
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from disagg.config import ConfigError
from disagg.engine.models.arch import LlamaArch
from disagg.engine.tokenizer import bos_eos_processor, bytes_to_unicode

log = structlog.get_logger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

GLOBAL_TENSOR_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp stores llama3 RoPE scaling as per-frequency factors (rope_freqs.weight), not as the four
# numbers; these are the (low_freq_factor, high_freq_factor, original context) Meta ships.
_LLAMA3_ROPE_CANDIDATES = ((1.0, 4.0, 8192),)

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                 "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_PLAIN_BYTE_LEVEL_PRE = ("default", "gpt2", "gpt-2")
# llama.cpp matches whole words against the vocabulary before merging for the Llama 3 family.
_IGNORE_MERGES_PRE = ("llama-bpe", "llama3", "llama-v3")
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
_BYTE_ALPHABET = bytes_to_unicode()


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer a GGUF file describes, ready to wrap in `Tokenizer`."""

    backend: tokenizers.Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None


class _PlainBufferReader(GGUFReader):
    """A GGUFReader whose buffer is a plain ndarray view of its memory map.

    Slicing an np.memmap runs Python-level bookkeeping on every slice; the reader slices ~250k times
    for a 49k-token vocabulary and dequantization slices per row group, which made loading SmolLM2
    take ~5 s instead of ~2.5 s. The view keeps the map alive and reads the same bytes.
    """

    @property
    def data(self) -> np.ndarray:
        return self._buffer

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buffer = np.asarray(value)


def open_reader(path: str) -> GGUFReader:
    """Open (memory-map) a GGUF file; a file that does not parse is a ConfigError."""
    try:
        return _PlainBufferReader(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ConfigError(f"{path} is not a readable GGUF file: {exc}") from exc


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key-value pair as plain Python values (str, int, float, bool or lists of them)."""
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or field.types.count(GGUFValueType.ARRAY) > 1:
            continue  # file header, or nested arrays (no Llama-family key uses them)
        if field.types[-1] == GGUFValueType.STRING:
            values = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        else:
            values = [field.parts[i].tolist()[0] for i in field.data]
        meta[name] = values if field.types[0] == GGUFValueType.ARRAY else values[0]
    return meta


def read_arch(meta: Mapping[str, Any], reader: GGUFReader) -> LlamaArch:
    """The architecture from `{arch}.*` metadata; vocab size from the embedding's rows."""
    name = meta.get("general.architecture")
    if name not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f"GGUF architecture {name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError("GGUF tensor token_embd.weight is missing")

    def key(suffix: str, default: Any = None) -> Any:
        value = meta.get(f"{name}.{suffix}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata {name}.{suffix} is missing")
        return value

    hidden, num_heads = key("embedding_length"), key("attention.head_count")
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ConfigError("GGUF files with a per-layer head_count_kv are not supported")
    head_dim = meta.get(f"{name}.attention.key_length") or hidden // num_heads
    rope_theta = float(key("rope.freq_base", 10000.0))
    if meta.get(f"{name}.rope.scaling.type", "none") != "none":
        raise ConfigError(f"GGUF RoPE scaling {meta[f'{name}.rope.scaling.type']!r} is not supported")
    freqs = tensors.get("rope_freqs.weight")
    return LlamaArch(
        vocab_size=int(tensors["token_embd.weight"].shape[-1]),  # GGUF shapes are [columns, rows]
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        rope_scaling=None if freqs is None else _llama3_scaling(_dequantized(freqs), head_dim, rope_theta),
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )


def read_weights(reader: GGUFReader, arch: LlamaArch, architecture: str, skip: Collection[str] = ()) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, in HF layout ([out, in]) under HF Llama names (but `skip`'s)."""
    weights = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into arch.rope_scaling by read_arch
        name = hf_name(tensor.name)
        if name not in skip:
            weights[name] = np.ascontiguousarray(_hf_rows(name, _dequantized(tensor), arch, architecture))
    return weights


@dataclass(frozen=True)
class GGUFBlocks:
    """A weight's quantized blocks as stored: `data` is uint8 [rows, bytes per row], rows in HF order."""

    type_name: str  # one of BLOCK_TYPES
    rows: int
    cols: int
    data: np.ndarray


BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the block formats `read_blocks` keeps undequantized


def read_blocks(reader: GGUFReader, arch: LlamaArch, architecture: str) -> dict[str, GGUFBlocks]:
    """The raw blocks of every 2-D weight stored in one of BLOCK_TYPES, under HF names.

    Blocks run along a row, so the Q/K row un-permutation applies to the bytes as it does to values.
    """
    blocks = {}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in BLOCK_TYPES or len(tensor.shape) != 2:
            continue
        name = hf_name(tensor.name)
        cols, rows = (int(n) for n in tensor.shape)  # GGUF shapes are [columns, rows]
        data = _hf_rows(name, np.asarray(tensor.data).reshape(rows, -1), arch, architecture)
        blocks[name] = GGUFBlocks(tensor.tensor_type.name, rows, cols, np.array(data, dtype=np.uint8, copy=True))
    return blocks


def _hf_rows(name: str, array: np.ndarray, arch: LlamaArch, architecture: str) -> np.ndarray:
    """Rows in HF order: llama's attn_q/attn_k rows un-permuted, every other tensor as it is."""
    if architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_rows(array, arch.num_heads)
    if architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_rows(array, arch.num_kv_heads)
    return array


def hf_name(gguf_name: str) -> str:
    """'blk.3.attn_q.weight' → 'model.layers.3.self_attn.q_proj.weight'; unknown names are a ConfigError."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[0] in GLOBAL_TENSOR_NAMES:
        return f"{GLOBAL_TENSOR_NAMES[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSOR_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_TENSOR_NAMES[parts[2]]}.{parts[3]}"
    raise ConfigError(f"GGUF tensor {gguf_name!r} is not part of a supported Llama-family model")


def unpermute_rows(array: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's `w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)` on the rows of attn_q/attn_k.

    Per head, llama.cpp interleaves the two rotary halves (row i of the first half, then row i of
    the second); this puts the halves back one after the other.
    """
    rows, rest = array.shape[0], array.shape[1:]
    half = rows // num_heads // 2
    return array.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def read_vocab(meta: Mapping[str, Any]) -> GGUFVocab:
    """A byte-level BPE tokenizer from `tokenizer.ggml.*` (tokens, merges, token types, pre-tokenizer)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)")
    tokens = meta["tokenizer.ggml.tokens"]
    pre = meta.get("tokenizer.ggml.pre", "default")
    alphabet = set(_BYTE_ALPHABET.values())
    spelled = [t if set(t) <= alphabet else _respell(t) for t in tokens]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    model = models.BPE(vocab={t: i for i, t in enumerate(spelled)}, merges=merges, ignore_merges=pre in _IGNORE_MERGES_PRE)
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, spelled, meta.get("tokenizer.ggml.token_type") or [])
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", pre in _IGNORE_MERGES_PRE) and bos_id is not None:
        backend.post_processor = bos_eos_processor(backend, bos_id, None)
    # llama.cpp ends generation at any end-of-generation id: EOS, end-of-turn and end-of-message.
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos_ids = tuple(dict.fromkeys(meta[k] for k in eos_keys if meta.get(k) is not None))
    return GGUFVocab(backend, bos_id, eos_ids, meta.get("tokenizer.chat_template"))


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":  # as SmolLM2's tokenizer.json: every digit is its own word
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre not in _PLAIN_BYTE_LEVEL_PRE:
        log.warning("unknown GGUF pre-tokenizer; using GPT-2's, tokens may differ from llama.cpp", pre=pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _add_special_tokens(backend: tokenizers.Tokenizer, tokens: list[str], spelled: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens; user-defined ones plain added tokens (as in HF).

    Both are matched whole in the text, so `<|im_start|>` is one id. A control token spelled
    outside the byte alphabet is a converter mislabel and is left alone, as transformers does.
    """
    control = [AddedToken(t, special=True, normalized=False)
               for t, s, kind in zip(tokens, spelled, types) if kind == _TOKEN_CONTROL and t and t == s]
    user = [AddedToken(t, special=False, normalized=False)
            for t, s, kind in zip(tokens, spelled, types) if kind == _TOKEN_USER_DEFINED and t and t == s]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _dequantized(tensor: Any) -> np.ndarray:
    array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    array = array.reshape([int(n) for n in reversed(tensor.shape)])
    # F32 tensors come back as views of the read-only memory map; torch wants memory it may own.
    return array if array.flags.writeable else array.copy()


def _llama3_scaling(factors: np.ndarray, head_dim: int, theta: float) -> tuple[float, float, float, int]:
    """Recover llama3 (factor, low_freq_factor, high_freq_factor, original_max) from rope_freqs."""
    factor = float(factors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    for low, high, old_len in _LLAMA3_ROPE_CANDIDATES:
        smooth = (old_len / wavelen - low) / (high - low)
        expected = np.where(
            wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, 1 / ((1 - smooth) / factor + smooth))
        )
        if np.allclose(expected, factors, rtol=1e-4):
            return (factor, low, high, old_len)
    raise ConfigError("GGUF rope_freqs.weight does not match llama3 RoPE scaling; use the HF folder of this model")


def _respell(token: str) -> str:
    return "".join(_BYTE_ALPHABET[b] for b in token.encode("utf-8"))
