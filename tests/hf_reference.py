"""HF reference models for tests (the builders live in disagg.bench.hf_baseline) and HF folder writing."""

from __future__ import annotations

from disagg.bench.hf_baseline import hf_config, hf_model_from_loaded
from disagg.engine.loader import LoadedModel

__all__ = ["hf_config", "hf_model_from_loaded", "save_hf_folder"]


def save_hf_folder(loaded: LoadedModel, folder: str, max_shard_size: str | None = None) -> None:
    """Write `loaded` as an HF folder: config.json, *.safetensors, generation_config.json, tokenizer files."""
    model = hf_model_from_loaded(loaded)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    loaded.tokenizer.save(folder)
