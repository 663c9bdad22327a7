"""Admission under load over real HTTP, with the in-process engine twin: an overloaded server answers
429 with Retry-After at once on every generate route and in every role (nothing reaches a worker), and
while its first tokens come past --ttft-objective-ms;
`priority` reaches the worker on every route."""

import asyncio
import re

import pytest
from fake_engine import FakeEngine, api_client, wait_for

from disagg.config import ConfigError, ServerConfig
from disagg.dp.protocol import WorkerState

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]
NEW_REQUESTS = {
    "/v1/completions": {"prompt": "a", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2},
    "/generate": {"text": "a", "sampling_params": {"max_new_tokens": 2}},
    "/inference/v1/generate": {"token_ids": [1], "sampling_params": {"max_tokens": 2}},
}
BATCHES = [("/generate", {"text": ["a", "b"]}), ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}),
           ("/v1/completions", {"prompt": "a", "max_tokens": 2, "n": 2}),
           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stream": True})]
TOO_MANY_WAITING = {"error": {
    "message": "the server has 8 requests waiting, its limit (--max-waiting-requests 8): retry later",
    "type": "RateLimitError", "param": None, "code": "too_many_waiting_requests"}}
KV_CACHE_FULL = {"error": {
    "message": "the KV cache of every DP worker is more than 90% used (the least: 92%), its limit "
               "(--max-kv-usage 0.9): retry later",
    "type": "RateLimitError", "param": None, "code": "kv_cache_over_limit"}}
ROOM = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}


def worker(rank, *, outstanding=0, running=0, free=100, alive=True):
    return WorkerState(dp_rank=rank, alive=alive, ready=alive, num_running=running, num_waiting=0,
                       num_free_blocks=free, num_total_blocks=100, num_outstanding_requests=outstanding)


async def answer(client, path, body):
    resp = await client.post(path, json=body)
    return resp.status, resp.headers.get("Retry-After"), await resp.json()


@pytest.mark.parametrize("mode", ["null", "prefill", "decode"])
@pytest.mark.parametrize("path", list(NEW_REQUESTS))
async def test_too_many_waiting_requests_is_a_429_at_once_on_every_route(path, mode):
    engine = FakeEngine()
    # rank 0: 7 outstanding, 2 running; rank 1: 4 outstanding, 1 running: 5 + 3 = 8 waiting.
    engine.states = [worker(0, outstanding=7, running=2), worker(1, outstanding=4, running=1)]
    body = NEW_REQUESTS[path] if mode == "null" else {**NEW_REQUESTS[path], **ROOM}
    async with api_client(engine, max_waiting_requests=8, disaggregation_mode=mode) as client:
        assert await answer(client, path, body) == (429, "1", TOO_MANY_WAITING)
        metrics = (await (await client.get("/metrics")).text()).splitlines()
        assert 'disagg_requests_refused_total{reason="too_many_waiting_requests"} 1.0' in metrics
        engine.states = [worker(0, outstanding=7, running=3), worker(1, outstanding=4, running=1)]  # 7 waiting
        status, retry_after, _ = await answer(client, path, body)
    assert (status, retry_after, len(engine.requests)) == (200, None, 1)


@pytest.mark.parametrize("path, body", BATCHES)
async def test_batches_choices_and_streams_are_refused_alike(path, body):
    engine = FakeEngine()
    engine.states = [worker(0, outstanding=8), worker(1)]
    async with api_client(engine, max_waiting_requests=8) as client:
        assert await answer(client, path, body) == (429, "1", TOO_MANY_WAITING)
    assert engine.requests == []


async def test_every_live_kv_cache_over_the_limit_is_a_429():
    engine = FakeEngine()
    engine.states = [worker(0, free=5), worker(1, free=8)]  # 95% and 92% used
    async with api_client(engine, max_kv_usage=0.9) as client:
        assert await answer(client, "/generate", NEW_REQUESTS["/generate"]) == (429, "1", KV_CACHE_FULL)
        engine.states = [worker(0, free=5), worker(1, free=10)]  # 90% is not over 0.9
        assert (await answer(client, "/generate", NEW_REQUESTS["/generate"]))[0] == 200
        engine.states = [worker(0, free=5), worker(1, free=50, alive=False)]  # a dead worker does not count
        status, _, body = await answer(client, "/generate", NEW_REQUESTS["/generate"])
    assert (status, body["error"]["message"]) == (429, "the KV cache of every DP worker is more than 90% used (the "
                                                       "least: 95%), its limit (--max-kv-usage 0.9): retry later")


async def test_without_limits_a_loaded_server_takes_every_request():
    engine = FakeEngine()
    engine.states = [worker(0, outstanding=500, free=0), worker(1, outstanding=500, free=0)]
    async with api_client(engine) as client:
        status, retry_after, _ = await answer(client, "/generate", NEW_REQUESTS["/generate"])
    assert (status, retry_after) == (200, None)


@pytest.mark.parametrize("path", list(NEW_REQUESTS))
async def test_priority_reaches_the_worker_on_every_route(path):
    engine = FakeEngine()
    async with api_client(engine) as client:
        assert (await answer(client, path, {**NEW_REQUESTS[path], "priority": -3}))[0] == 200
        assert (await answer(client, path, NEW_REQUESTS[path]))[0] == 200
    assert [msg.priority for msg, _ in engine.requests] == [-3, 0]


@pytest.mark.parametrize("field, value, message", [
    ("max_waiting_requests", -1, "max_waiting_requests must be >= 0 (0: no limit), got -1"),
    ("max_kv_usage", 0.0, "max_kv_usage must be in (0, 1] (1: off), got 0.0"),
    ("max_kv_usage", 1.5, "max_kv_usage must be in (0, 1] (1: off), got 1.5"),
])
async def test_limits_out_of_range_are_config_errors(field, value, message):
    with pytest.raises(ConfigError) as err:
        ServerConfig(**{field: value})
    assert str(err.value) == message


TTFT_REFUSAL = re.compile(r"the server's requests waited at least (\d+) ms for their first token lately \(the last 3 "
                          r"answered in 10 s; 1 waiting now, the longest for (\d+) ms\), past its objective "
                          r"\(--ttft-objective-ms 200\): "
                          r"retry later")


@pytest.mark.parametrize("mode", ["null", "decode"])
async def test_first_tokens_late_with_one_waiting_is_a_429(mode):
    """Three requests waited 400 ms each for their first token, past a 200 ms objective: once a fourth has
    waited half the objective for its own, a fifth is refused at once; once none waits, requests are taken
    again (a request just taken does not shut the door: tests/unit/test_admission_ttft.py)."""
    engine = FakeEngine(token_delay_s=0.4)
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1}, **({} if mode == "null" else ROOM)}
    async with api_client(engine, ttft_objective_ms=200, disaggregation_mode=mode) as client:
        for _ in range(3):
            assert (await client.post("/generate", json=body)).status == 200
        waiting = asyncio.create_task(client.post("/generate", json=body))
        await wait_for(lambda: len(engine.requests) == 4)
        await asyncio.sleep(0.15)  # the fourth has waited past half the objective (and 0.25 s from its token)
        status, retry_after, refused = await answer(client, "/generate", body)
        assert (await waiting).status == 200
        status_after = (await client.post("/generate", json=body)).status
        metrics = await (await client.get("/metrics")).text()
    error = refused["error"]
    waited_ms, longest_ms = map(int, TTFT_REFUSAL.fullmatch(error["message"]).groups())
    assert (status, retry_after, error["type"], error["code"], status_after) == (
        429, "1", "RateLimitError", "ttft_over_objective", 200)
    assert 400 <= waited_ms < 1000 and 150 <= longest_ms < 400
    assert len(engine.requests) == 5  # the refused one reached no worker
    assert 'disagg_requests_refused_total{reason="ttft_over_objective"} 1.0' in metrics.splitlines()


async def test_a_negative_ttft_objective_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        ServerConfig(ttft_objective_ms=-1)
    assert str(err.value) == "ttft_objective_ms must be >= 0 (0: off), got -1"
