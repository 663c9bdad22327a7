"""EngineConfig values found per DP worker."""

from __future__ import annotations

from disagg.engine_config import EngineConfig, ModelConfig


def test_each_dp_rank_takes_its_own_gpu_where_the_device_names_none():
    cuda = EngineConfig(model=ModelConfig(device="cuda"))
    assert [cuda.for_dp_rank(rank).model.device for rank in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert cuda.for_dp_rank(1).cache == cuda.cache and cuda.model.device == "cuda"  # a new config; this one unchanged
    pinned, cpu = EngineConfig(model=ModelConfig(device="cuda:3")), EngineConfig()
    assert pinned.for_dp_rank(1) is pinned and pinned.model.device == "cuda:3"
    assert cpu.for_dp_rank(1) is cpu and cpu.model.device == "cpu"
