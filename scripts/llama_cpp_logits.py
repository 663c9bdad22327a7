"""Dump llama.cpp's logits for four prompts on a GGUF (run with the llama.cpp venv of docs/benchmarks.md).

    peers/llama/bin/python scripts/llama_cpp_logits.py MODEL.gguf OUT.json
    .venv/bin/python scripts/compare_llama_cpp.py OUT.json     # our engine on the same tokens
"""
import json
import sys

import numpy as np
from llama_cpp import Llama
gguf = sys.argv[1]
prompts = ["The capital of France is Paris, and the capital of Germany is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Once upon a time, in a small village by the river, there lived an old miller who",
           "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain,"]
llm = Llama(model_path=gguf, logits_all=True, n_ctx=512, n_threads=2, verbose=False)
out = []
for p in prompts:
    toks = llm.tokenize(p.encode(), add_bos=False, special=True)
    llm.reset(); llm.eval(toks)
    logits = np.array(llm.scores[: len(toks)], dtype=np.float32)
    out.append({"tokens": toks, "logits": logits.tolist()})
json.dump(out, open(sys.argv[2], "w"))
print("dumped", [len(o["tokens"]) for o in out])
