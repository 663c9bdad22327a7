"""A unified server whose DP worker is a tensor-parallel group of 2 processes (tiny model): its
answers equal a TP 1 server's token for token, its follower runs beside its worker and is gone
after the server stops; a follower killed (kill -9) takes its group down, its request in flight
gets 503, and the group restarts with every gauge back at its baseline; prefill and decode servers
refuse TP on CUDA for now (tests/e2e/test_pd_tensor_parallel.py runs them on the CPU)."""

import asyncio
import os
import signal
from dataclasses import replace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.config import ConfigError, ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.launch import start_server
from pd_cluster import TINY, pd_config

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
TP2 = replace(TINY, tensor_parallel_size=2)
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2  # chunked prefill on the tiny config


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


async def answers(port: int) -> list:
    out = []
    async with aiohttp.ClientSession() as s:
        for prompt in ("hello", LONG):
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": prompt, **GREEDY}) as r:
                out.append((r.status, (await r.json())["choices"][0]["text"]))
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
        async with s.post(f"http://127.0.0.1:{port}/generate", json=body) as r:
            out.append((r.status, (await r.json())["output_ids"]))
    return out


async def test_a_tp2_worker_answers_like_tp1_and_takes_its_follower_down(unified):
    server = await start_server(ServerConfig(port=0, dp_size=1), TP2, DisaggConfig(), lambda _: None)
    try:
        [worker] = server.controller.workers
        followers = children(worker.process.pid)
        assert len(followers) == 1  # rank 1; rank 0 is the worker process itself
        got = await answers(server.port)
    finally:
        await server.close()
    assert got == await answers(unified.port)
    assert [s for s, _ in got] == [200, 200, 200]
    assert not os.path.exists(f"/proc/{followers[0]}")


async def test_prefill_and_decode_servers_refuse_tp_on_cuda_for_now():
    on_cuda = replace(TP2, model=replace(TP2.model, device="cuda:0"))
    with pytest.raises(ConfigError, match=r"^prefill and decode servers with tensor_parallel_size > 1 run on the CPU "
                       r"for now \(a TP group moves its KV from one shared host region\), not on cuda:0$"):
        await start_server(ServerConfig(port=0, disaggregation_mode="decode"), on_cuda, pd_config("tcp"), lambda _: None)


GAUGES = ("disagg_num_requests_running", "disagg_num_requests_waiting", "disagg_num_free_blocks",
          "disagg_num_total_blocks", "disagg_num_quarantined_blocks", "disagg_worker_ready", "disagg_worker_restarts")


async def gauges(port: int) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return {m.name: m.value for f in text_string_to_metric_families(text) for m in f.samples if m.name in GAUGES}


async def settled(port: int, wanted) -> dict[str, float]:
    """The gauges once `wanted(gauges)` holds (the workers report their state every few tenths of a
    second), or the last ones read after 10 s."""
    for _ in range(100):
        now = await gauges(port)
        if wanted(now):
            break
        await asyncio.sleep(0.1)
    return now


async def test_a_dead_follower_takes_its_group_down_and_the_group_restarts(unified):
    server = await start_server(ServerConfig(port=0, dp_size=1, worker_restart_backoff_s=0.1), TP2, DisaggConfig(),
                                lambda _: None)
    try:
        baseline = await settled(server.port, lambda g: g["disagg_num_total_blocks"] > 0)
        assert baseline["disagg_num_free_blocks"] == baseline["disagg_num_total_blocks"] == 96  # TINY's cache
        assert (baseline["disagg_num_requests_running"], baseline["disagg_worker_ready"]) == (0, 1)
        body = {"prompt": "hello", "temperature": 0, "ignore_eos": True, "max_tokens": 370}
        async with aiohttp.ClientSession() as s:
            in_flight = asyncio.ensure_future(s.post(f"http://127.0.0.1:{server.port}/v1/completions", json=body))
            for _ in range(100):  # the request runs on the group before one of its ranks dies
                if (await gauges(server.port))["disagg_num_requests_running"] == 1:
                    break
                await asyncio.sleep(0.02)
            [follower] = children(server.controller.workers[0].process.pid)
            os.kill(follower, signal.SIGKILL)
            async with await in_flight as r:
                status, answer = r.status, await r.json()
        assert status == 503 and answer["error"]["message"].startswith("DP worker 0 died ("), answer
        for _ in range(300):
            worker = server.controller.workers[0]
            if worker.num_restarts == 1 and worker.available:
                break
            await asyncio.sleep(0.1)
        assert (worker.num_restarts, worker.available) == (1, True)
        assert len(children(worker.process.pid)) == 1  # a new follower
        assert await answers(server.port) == await answers(unified.port)
        expected = {**baseline, "disagg_worker_restarts": 1.0}  # every block back, nothing running
        assert await settled(server.port, lambda g: g == expected) == expected
    finally:
        await server.close()
