"""Admin and utility routes over real HTTP against the fake engine."""

import asyncio
import re

import pytest
from fake_engine import FakeEngine, LONG_MODEL, api_client, open_generate_streams

from disagg.dp.protocol import UtilityFailed

pytestmark = pytest.mark.timeout(30)


async def call(client, method, path, **kw):
    resp = await client.request(method, path, **kw)
    ctype = resp.headers.get("Content-Type", "")
    return resp.status, (await resp.json() if ctype.startswith("application/json") else await resp.text())


def error(message, error_type, param=None, code=None):
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


async def test_health_follows_the_workers():
    engine = FakeEngine(dp_size=3)
    async with api_client(engine) as client:
        assert await call(client, "GET", "/health") == (200, "")
        engine.alive[2] = False
        assert await call(client, "GET", "/health") == (200, {
            "status": "degraded", "message": "DP workers down: dp_rank 2 dead", "dp_ranks_down": [2]})
        engine.alive[:] = [False] * 3
        assert await call(client, "GET", "/health") == (503, error(
            "engine is not healthy (dp_rank 0 dead, dp_rank 1 dead, dp_rank 2 dead)", "ServiceUnavailableError"))


async def test_health_generate_runs_one_token_on_every_worker():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine) as client:
        assert await call(client, "GET", "/health_generate") == (200, "")
        assert sorted(r for _, r in engine.requests) == [0, 1]
        assert {(m.sampling.max_tokens, tuple(m.prompt_token_ids)) for m, _ in engine.requests} == {(1, (0,))}
        engine.sleeping[1] = True
        assert await call(client, "GET", "/health_generate") == (503, error(
            "health generation failed (dp_rank 1: the engine is sleeping; call wake_up() first)", "ServiceUnavailableError"))


async def test_health_generate_on_a_decode_server_is_health():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine, disaggregation_mode="decode") as client:
        assert await call(client, "GET", "/health_generate") == (200, "")
    assert engine.requests == []


async def test_server_info_and_alias():
    engine = FakeEngine(dp_size=2, load_balance_method="follow_bootstrap_room")
    async with api_client(engine, disaggregation_mode="prefill", dp_size=2) as client:
        status, info = await call(client, "GET", "/server_info")
        assert await call(client, "GET", "/get_server_info") == (status, info)
    assert status == 200
    assert info == {
        "model_path": "fake-model", "served_model_name": "fake-model", "max_model_len": 64, "vocab_size": 1000,
        "engine": "", "dp_size": 2, "load_balance_method": "follow_bootstrap_room", "disaggregation_mode": "prefill",
        "internal_states": [
            {"dp_rank": r, "alive": True, "ready": True, "num_running": 0, "num_waiting": r, "num_free_blocks": 100 - r,
             "num_total_blocks": 128, "num_outstanding_requests": 0, "num_restarts": r,
             "num_quarantined_blocks": 3 * r, "block_size": 16, "prefix_cache_queries": 0,
             "prefix_cache_hits": 0, "num_waiting_deferred": 0, "pd": None} for r in (0, 1)],
    }


async def test_model_info_and_alias():
    async with api_client(FakeEngine()) as client:
        status, info = await call(client, "GET", "/model_info")
        assert await call(client, "GET", "/get_model_info") == (status, info)
    assert (status, info) == (200, {"model_path": "fake-model", "tokenizer_path": "fake-model",
                                    "served_model_name": "fake-model", "is_generation": True, "max_model_len": 64,
                                    "vocab_size": 1000})


def sample(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert match, f"{name}{labels} not in metrics"
    return float(match.group(1))


async def test_metrics_counts_requests_tokens_latency_and_workers():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine) as client:
        await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 4})
        await client.post("/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 2}})
        await client.post("/v1/completions", json={"prompt": "a", "n": 0})  # a 400
        await client.get("/nope")
        resp = await client.get("/metrics")
        text = await resp.text()
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert sample(text, "disagg_requests_total", '{endpoint="/v1/completions",status="200"}') == 1
    assert sample(text, "disagg_requests_total", '{endpoint="/v1/completions",status="400"}') == 1
    assert sample(text, "disagg_requests_total", '{endpoint="/generate",status="200"}') == 1
    assert sample(text, "disagg_requests_total", '{endpoint="unmatched",status="404"}') == 1
    assert sample(text, "disagg_prompt_tokens_total") == 4
    assert sample(text, "disagg_generation_tokens_total") == 6
    assert sample(text, "disagg_time_to_first_token_seconds_count") == 2
    assert sample(text, "disagg_e2e_request_latency_seconds_count") == 2
    assert sample(text, "disagg_time_per_output_token_seconds_count") == 2
    assert sample(text, "disagg_num_requests_waiting", '{dp_rank="1"}') == 1
    assert sample(text, "disagg_num_free_blocks", '{dp_rank="0"}') == 100
    assert sample(text, "disagg_num_requests_running", '{dp_rank="0"}') == 0
    assert sample(text, "disagg_num_quarantined_blocks", '{dp_rank="1"}') == 3
    assert sample(text, "disagg_worker_restarts", '{dp_rank="1"}') == 1


async def test_abort_requests_by_rid_and_all():
    engine = FakeEngine(dp_size=2, model=LONG_MODEL, token_delay_s=0.02)
    async with api_client(engine) as client:
        streams = await open_generate_streams(client, ("a1", "a2", "a3"))
        assert await call(client, "POST", "/abort_request", json={"rid": "a1"}) == (200, {"aborted": ["a1"]})
        bodies = [await streams[0].text()]
        assert await call(client, "POST", "/abort_requests", json={"rid": "missing"}) == (200, {"aborted": []})
        status, body = await call(client, "POST", "/abort_requests", json={"abort_all": True})
        bodies += [await resp.text() for resp in streams[1:]]
        assert await call(client, "POST", "/abort_requests", json={}) == (
            400, error("send a rid, request_ids or abort_all: true", "BadRequestError", "rid"))
    assert (status, sorted(body["aborted"])) == (200, ["a2", "a3"])
    assert all('"finish_reason":{"type":"abort"' in b and b.endswith("data: [DONE]\n\n") for b in bodies)
    assert engine.aborted == []  # every stream ended through engine.abort, none by closing early


async def test_is_sleeping_sleep_and_wake_up():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine) as client:
        assert await call(client, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
        assert await call(client, "POST", "/sleep?level=2") == (200, {"success": True, "level": 2})
        assert await call(client, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
        status, body = await call(client, "POST", "/v1/completions", json={"prompt": "a"})
        assert (status, body["error"]["message"]) == (503, "the engine is sleeping; call wake_up() first")
        assert await call(client, "POST", "/wake_up") == (200, {"success": True})
        assert await call(client, "POST", "/sleep", json={"level": 1}) == (200, {"success": True, "level": 1})
        assert await call(client, "POST", "/sleep") == (200, {"success": True, "level": 1})
        assert await call(client, "POST", "/sleep?level=3") == (400, error("level must be 1 or 2, got 3", "BadRequestError", "level"))
        assert await call(client, "POST", "/sleep?level=x") == (400, error("level must be 1 or 2, got 'x'", "BadRequestError", "level"))
    assert [c for c in engine.utility_calls if c[0] == "sleep"] == [("sleep", (2,)), ("sleep", (1,)), ("sleep", (1,))]


async def test_is_sleeping_disagreement_is_500_listing_every_worker():
    engine = FakeEngine(dp_size=3)
    engine.sleeping = [True, False, True]
    async with api_client(engine) as client:
        assert await call(client, "GET", "/is_sleeping") == (500, error(
            "is_sleeping: DP workers disagree (dp_rank 0: True, dp_rank 1: False, dp_rank 2: True)",
            "InconsistentUtilityResults"))


async def test_reset_prefix_cache_is_an_and_over_workers():
    engine = FakeEngine(dp_size=3)
    async with api_client(engine) as client:
        assert await call(client, "POST", "/reset_prefix_cache") == (200, {"success": True})
        engine.reset_ok[1] = False
        assert await call(client, "POST", "/reset_prefix_cache") == (500, error(
            "reset_prefix_cache failed on 1 DP worker(s) (dp_rank 1: returned False)", "UtilityFailed"))
        assert (await call(client, "POST", "/flush_cache"))[0] == 500


async def test_utility_failures_and_empty_answers():
    engine = FakeEngine(dp_size=2)
    async with api_client(engine) as client:
        engine.utility_results["is_sleeping"] = []
        assert await call(client, "GET", "/is_sleeping") == (500, error("is_sleeping: no DP worker answered", "UtilityFailed"))
        engine.utility_results["wake_up"] = [None, False]
        assert await call(client, "POST", "/wake_up") == (500, error(
            "wake_up failed on 1 DP worker(s) (dp_rank 1: returned False)", "UtilityFailed"))
        engine.utility_results.clear()
        engine.alive[0] = False
        assert await call(client, "POST", "/reset_prefix_cache") == (503, error(
            "reset_prefix_cache: DP worker 0 is not running", "ServiceUnavailableError"))


async def test_utility_failed_from_the_engine_is_500():
    engine = FakeEngine(dp_size=2)

    async def failing(method, *args):
        raise UtilityFailed(method, {1: "CUDA out of memory"})

    engine.call_utility = failing
    async with api_client(engine) as client:
        assert await call(client, "POST", "/sleep") == (500, error(
            "sleep failed on 1 DP worker(s) (dp_rank 1: CUDA out of memory)", "UtilityFailed"))


async def test_utility_timeout_is_503():
    engine = FakeEngine(dp_size=2)

    async def slow(method, *args):
        raise asyncio.TimeoutError()

    engine.call_utility = slow
    async with api_client(engine) as client:
        assert await call(client, "GET", "/is_sleeping") == (503, error(
            "the engine did not answer in time", "ServiceUnavailableError"))


async def test_a_failed_role_switch_turns_health_red_and_refuses_requests():
    from disagg.config import DisaggregationMode
    from disagg.dp.role_switch import PdRoles, SwitchState

    engine = FakeEngine(dp_size=2)
    async with api_client(engine, disaggregation_mode="decode") as client:
        engine.pd_roles = PdRoles(DisaggregationMode.DECODE, {}, {}, epoch=3, state=SwitchState.FAILED,
                                  failure="UtilityFailed: switch_role failed on 1 DP worker(s)")
        refusal = error("this server's role switch failed (UtilityFailed: switch_role failed on 1 DP worker(s)): it "
                        "serves nothing until restarted", "ServiceUnavailableError", code="role_switching")
        assert await call(client, "GET", "/health") == (503, refusal)
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        assert await call(client, "POST", "/generate", json=body) == (503, refusal)
        status, info = await call(client, "GET", "/server_info")
    assert (status, info["pd_role_epoch"], info["pd_role_switch_state"]) == (200, 3, "failed")
    assert engine.requests == []
