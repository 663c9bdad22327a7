"""Write a model as an HF folder (config.json, model.safetensors, tokenizer files) for a peer server.

vLLM CPU reads HF folders; this gives it the very weights our engine runs: the default model's GGUF
dequantized to float32, as `--dtype float32 --quantization none` loads it (docs/benchmarks.md).

    .venv/bin/python scripts/hf_folder.py OUT_DIR [MODEL]      # MODEL: smollm2-135m (default) or a path
"""
import sys

from disagg.bench.hf_baseline import save_hf_folder
from disagg.engine_config import ModelConfig
from disagg.engine.loader import load_model


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    loaded = load_model(ModelConfig(model=argv[2]) if len(argv) == 3 else ModelConfig())
    save_hf_folder(loaded, argv[1])
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
