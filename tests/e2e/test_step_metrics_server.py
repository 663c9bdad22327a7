"""Per-step engine metrics off a real server: each DP worker publishes its steps on ZMQ
(`--step-metrics-endpoint`) and /metrics summarises them; a request's steps add up to its prompt and
its generated tokens exactly."""

import asyncio
import socket

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from disagg.config import ServerConfig
from disagg.launch import start_server
from disagg.pd_config import DisaggConfig
from disagg.wire.engine_msgs import StepsMsg
from pd_cluster import TINY

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


NAMES = ('disagg_engine_step_prefill_tokens_sum{dp_rank="0"}', 'disagg_engine_step_decode_seqs_sum{dp_rank="0"}',
         'disagg_engine_step_decode_kv_tokens_total{dp_rank="0"}', 'disagg_engine_step_seconds_count{dp_rank="0"}')


def sums(metrics_text: str, names: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            out[name] = float(value)
    return out


async def until_subscribed(session, url: str, sub) -> None:
    """ZMQ drops what a PUB sends before its subscriber's subscription arrived: one-token requests until
    a report comes, then every report in flight is read, so the next request's reports come whole."""
    for _ in range(20):
        async with session.post(url + "/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}):
            pass
        try:
            await asyncio.wait_for(sub.recv_multipart(), 1.0)
            break
        except asyncio.TimeoutError:
            continue
    while True:
        try:
            await asyncio.wait_for(sub.recv_multipart(), 1.0)
        except asyncio.TimeoutError:
            return


async def test_a_requests_steps_on_zmq_and_on_metrics_add_up_to_its_tokens():
    port = free_port()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"step_metrics")
    sub.bind(f"tcp://127.0.0.1:{port}")  # the worker connects to a non-wildcard endpoint (vLLM's rule)
    server = await start_server(ServerConfig(port=0, dp_size=1, step_metrics_endpoint=f"tcp://127.0.0.1:{port}"),
                                TINY, DisaggConfig(), lambda _: None)
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{server.port}"
            await until_subscribed(session, url, sub)
            async with session.get(url + "/metrics") as r:
                before = sums(await r.text(), NAMES)  # the subscription's own requests' steps
            body = {"input_ids": list(range(40, 63)), "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                          "ignore_eos": True}}
            async with session.post(url + "/generate", json=body) as r:
                assert r.status == 200 and len((await r.json())["output_ids"]) == 6
            steps, seqs = [], []
            while sum(s.num_decode_seqs for s in steps) < 5:
                topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 10)
                report = msgspec.msgpack.decode(payload, type=StepsMsg)
                assert (topic, int.from_bytes(seq, "big"), report.dp_rank) == (b"step_metrics", report.seq, 0)
                steps += report.steps
                seqs.append(report.seq)
            # 23 prompt tokens in chunks of 16 and 7, then 5 decode steps over 24..28 tokens of KV.
            assert [(s.num_prefill_tokens, s.num_decode_seqs, s.num_decode_kv_tokens) for s in steps] == [
                (16, 0, 0), (7, 0, 0), (0, 1, 24), (0, 1, 25), (0, 1, 26), (0, 1, 27), (0, 1, 28)]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
            for _ in range(20):  # the front's copy of the last report may land just after ZMQ's
                async with session.get(url + "/metrics") as r:
                    after = sums(await r.text(), NAMES)
                if after.get(NAMES[3], 0.0) - before.get(NAMES[3], 0.0) >= 7:
                    break
                await asyncio.sleep(0.1)
            assert {name: after[name] - before.get(name, 0.0) for name in NAMES} == dict(zip(NAMES, (23.0, 5.0, 130.0, 7.0)))
    finally:
        await server.close()
        sub.close()
        ctx.term()
