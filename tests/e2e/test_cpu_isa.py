"""`disagg unified` on a bfloat16 dense model, run as each CPU level this machine can stand for
(DISAGG_CPU_ISA): it starts, its ready line names the level and the weights' path, and it answers with
the greedy tokens of the offline engine under the same kernels. On an AVX2 CPU oneDNN refuses bfloat16
weights; the engine must never pick that path there."""

from __future__ import annotations

import os

import aiohttp
import pytest
import torch

from cli_process import ready_url, start_cli
from disagg.engine.llm import LLM
from disagg.ops.cpu import Isa, cpu_features, features_of, read_flags
from disagg.types import SamplingParams

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio]

PROMPT = [5, 17, 99, 3, 250, 41, 7]
LEVELS = [isa for isa in Isa if isa.rank <= cpu_features().hardware_isa.rank]
# How the level's engine holds tiny's 9 bfloat16 matmul weights: csrc's tiles where its dense_matmul is
# the fast kernel (avx512, avx2) and the CPU has no native bf16; else oneDNN, widened where it has no bf16.
WEIGHTS = {
    "tiles": "9 bfloat16 dense (csrc dense_matmul)",
    "widened": "9 bfloat16 dense as float32 (oneDNN packed; no oneDNN bf16 on this CPU)",
    "onednn": "9 bfloat16 dense (oneDNN packed)",
}


def expected_weights(isa: Isa) -> str:
    features = features_of(read_flags(), isa.value)
    if isa is not Isa.BASE and not features.native_bf16:
        return WEIGHTS["tiles"]
    return WEIGHTS["onednn" if features.onednn_bf16 else "widened"]


def offline_tokens(isa: Isa, monkeypatch) -> list[int]:
    """The greedy tokens of an in-process engine whose csrc kernels and weight paths are the level's
    (the same bits)."""
    from disagg.ops import linear, load_ops

    load_ops("csrc")  # loads the library
    monkeypatch.setattr(linear, "cpu_features", lambda: features_of(read_flags(), isa.value))
    in_force = torch.ops.disagg.isa()
    torch.ops.disagg.set_isa(isa.value)
    try:
        llm = LLM("tiny", dtype="bfloat16", quantization="none")
        [out] = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))
        return list(out.outputs.token_ids)
    finally:
        torch.ops.disagg.set_isa(in_force)


@pytest.mark.parametrize("isa", LEVELS, ids=[isa.value for isa in LEVELS])
async def test_a_bfloat16_model_starts_and_answers_as_every_cpu_level(isa, monkeypatch):
    env = dict(os.environ, DISAGG_CPU_ISA=isa.value)
    proc, lines = await start_cli("unified", "--model", "tiny", "--dtype", "bfloat16", "--quantization", "none",
                                  "--port", "0", env=env)
    try:
        ready = lines[-1]
        assert f"; cpu {features_of(read_flags(), isa.value).describe()}, dtype bfloat16 (set by --dtype), " in ready
        assert f"kernels csrc-{isa.value} (auto: csrc built, runs its {isa.value} code)" in ready
        assert f"quantization none: {expected_weights(isa)}, kv cache bfloat16" in ready
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        async with aiohttp.ClientSession() as s, s.post(ready_url(lines) + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert answer["output_ids"] == offline_tokens(isa, monkeypatch)
    finally:
        proc.terminate()
        await proc.wait()
