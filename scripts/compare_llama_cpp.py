"""Our engine against llama.cpp on the same GGUF and tokens: next-token logprob differences and argmax agreement.

    .venv/bin/python scripts/compare_llama_cpp.py OUT.json   # OUT.json from scripts/llama_cpp_logits.py
"""
import json
import sys

import numpy as np
import torch

from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
from disagg.engine.core import EngineCore
from disagg.engine.loader import load_model
from disagg.engine.models.llama import ForwardBatch, PrefillSegment
data = json.load(open(sys.argv[1]))
for q, dt in (("gguf", "float32"), ("gguf", "bfloat16"), ("none", "float32")):
    loaded = load_model(ModelConfig(quantization=q))
    core = EngineCore(EngineConfig(model=ModelConfig(quantization=q, dtype=dt), cache=CacheConfig(num_blocks=64)), loaded)
    model, cache = core.runner.model, core.runner.kv_cache
    maxd, meand, agree, total = 0.0, [], 0, 0
    for item in data:
        toks = item["tokens"]; n = len(toks)
        bs = core.block_size; nb = (n + bs - 1) // bs
        batch = ForwardBatch(torch.tensor(toks), torch.arange(n), torch.tensor([p // bs for p in range(n)]),
                             torch.tensor([p % bs for p in range(n)]), None, [PrefillSegment(0, n, 0, torch.arange(nb))],
                             torch.arange(n))
        ours = torch.log_softmax(model.forward(batch, cache), -1)
        ref = torch.log_softmax(torch.tensor(item["logits"]), -1)
        # log-probabilities of the tokens that follow, and the argmax at every position
        nxt = torch.tensor(toks[1:])
        d = (ours[:-1].gather(1, nxt[:, None]) - ref[:-1].gather(1, nxt[:, None])).abs().squeeze(1)
        maxd = max(maxd, d.max().item()); meand.append(d.mean().item())
        agree += (ours.argmax(-1) == ref.argmax(-1)).sum().item(); total += n
    print(f"{q} {dt}: next-token logprob |diff| vs llama.cpp: mean {np.mean(meand):.3f}, max {maxd:.3f}; argmax equal at {agree}/{total} positions")
