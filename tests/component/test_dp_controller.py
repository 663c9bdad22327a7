"""The DP controller with real engine worker processes (tiny model)."""

import asyncio
import os
import signal

import pytest

from component.fake_engine import api_client
from disagg.config import ServerConfig
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
from disagg.dp.controller import DPController
from disagg.dp.protocol import UtilityFailed, WorkerUnavailable
from disagg.engine.core import EngineCore
from disagg.types import FinishReason, SamplingParams
from disagg.wire.engine_msgs import GenerateMsg
from engine_runs import run_requests

pytestmark = pytest.mark.timeout(120)
ENGINE = EngineConfig(model=ModelConfig(model="tiny", dtype="float32"), cache=CacheConfig(num_blocks=64, block_size=4))
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture
async def controller(request):
    migration_limit = getattr(request, "param", 1)
    c = DPController(ServerConfig(dp_size=2, port=0, load_balance_method="round_robin", migration_limit=migration_limit),
                     ENGINE)
    await c.start()
    yield c
    await c.close()


async def collect(c, msg, rank):
    return [o async for o in c.generate(msg, rank)]


def expected_tokens(prompt: str) -> list[int]:
    core = EngineCore(ENGINE)
    return run_requests(core, [(core.tokenizer.encode(prompt), GREEDY)])[0].outputs.token_ids


async def test_each_rank_serves_the_same_greedy_tokens(controller):
    want = expected_tokens("hello")
    for rank in (0, 1):
        outs = await collect(controller, GenerateMsg(f"r{rank}", GREEDY, prompt="hello"), rank)
        assert [t for o in outs for t in o.new_token_ids] == want
        assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
        assert outs[-1].num_output_tokens == 6 and outs[0].num_prompt_tokens == 6  # BOS + 5 bytes
    assert [controller.pick_rank(None, None) for _ in range(3)] == [0, 1, 0]
    assert controller.model.name == "tiny" and controller.model.vocab_size == 320


async def test_bad_request_gets_its_error_and_the_worker_lives_on(controller):
    [out] = await collect(controller, GenerateMsg("bad", GREEDY, prompt_token_ids=[1, 999]), 1)
    assert (out.error, out.error_status, out.error_param) == ("token id 999 is out of vocabulary (vocab_size=320)", 400, "prompt")
    ok = await collect(controller, GenerateMsg("good", GREEDY, prompt_token_ids=[1, 2]), 1)
    assert ok[-1].finish_reason == "length"


async def test_utilities_fan_out_and_one_sleeping_worker_disagrees(controller):
    assert await controller.call_utility("is_sleeping") == [False, False]
    await controller.call_utility("sleep", 1, ranks=[1])
    assert await controller.call_utility("is_sleeping") == [False, True]
    [out] = await collect(controller, GenerateMsg("z", GREEDY, prompt="hi"), 1)
    assert (out.error, out.error_status) == ("the engine is sleeping; call wake_up() first", 503)
    await controller.call_utility("wake_up")
    assert await controller.call_utility("is_sleeping") == [False, False]
    with pytest.raises(UtilityFailed, match=r"^sleep failed on 2 DP worker\(s\) \(dp_rank 0: InvalidRequest: sleep level must be 1 or 2, got 3, dp_rank 1: InvalidRequest: sleep level must be 1 or 2, got 3\)$"):
        await controller.call_utility("sleep", 3)


async def test_closing_the_stream_early_aborts_and_frees_blocks(controller):
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    stream = controller.generate(GenerateMsg("long", long, prompt="x" * 30), 0)
    first = await stream.__anext__()
    assert first.new_token_ids
    await stream.aclose()
    for _ in range(50):
        [stats] = await controller.call_utility("stats", ranks=[0])
        if stats.num_free_blocks == 64 and stats.num_running == 0:
            break
        await asyncio.sleep(0.05)
    assert (stats.num_free_blocks, stats.num_running) == (64, 0)


async def test_an_id_used_again_at_once_gets_its_own_answer_not_the_abort_of_the_first(controller):
    # A router that gives up on a leg sends the same request (the same X-Request-Id) elsewhere, maybe
    # to this server again: the worker's answer to the first one's abort must not end the second.
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    first = controller.generate(GenerateMsg("same", long, prompt="x" * 30), 0)
    assert (await first.__anext__()).new_token_ids
    await first.aclose()  # the abort is on its way to worker 0; its answer is not back yet
    outs = await collect(controller, GenerateMsg("same", GREEDY, prompt="hello"), 0)
    assert [t for o in outs for t in o.new_token_ids] == expected_tokens("hello")
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    assert {o.request_id for o in outs} == {"same"}


async def test_a_worker_connection_cancelled_at_shutdown_logs_no_error(controller):
    # asyncio.run cancels what is left at the end of `disagg serve`: a worker connection's task among them.
    loop, errors = asyncio.get_running_loop(), []
    loop.set_exception_handler(lambda _, context: errors.append(context["message"]))
    try:
        tasks = [t for t in asyncio.all_tasks() if t.get_coro().__name__ == "_on_connect"]
        assert len(tasks) == 2  # one a worker
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)  # the stream's done-callback runs after the task
        assert errors == []
    finally:
        loop.set_exception_handler(None)


async def test_a_request_of_a_dead_worker_goes_on_on_the_other_one(controller):
    """Migration: the stream goes on from where it was, with the tokens of an undisturbed run."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    expected = [t for o in await collect(controller, GenerateMsg("undisturbed", params, prompt="y" * 30), 0)
                for t in o.new_token_ids]
    stream = controller.generate(GenerateMsg("moved", params, prompt="y" * 30), 1)
    outs = [await stream.__anext__()]
    os.kill(controller.workers[1].process.pid, signal.SIGKILL)
    outs += [o async for o in stream]
    assert ([t for o in outs for t in o.new_token_ids], outs[-1].error, outs[-1].finish_reason) == (
        expected, None, FinishReason.LENGTH)
    assert len(expected) == 200


@pytest.mark.parametrize("controller", [0], indirect=True)  # --migration-limit 0
async def test_a_dead_worker_fails_its_requests_with_503_not_a_hang(controller):
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    stream = controller.generate(GenerateMsg("doomed", long, prompt="y" * 30), 1)
    await stream.__anext__()
    os.kill(controller.workers[1].process.pid, signal.SIGKILL)
    outs = [o async for o in stream]
    assert outs[-1].error.startswith("DP worker 1 died") and outs[-1].error_status == 503
    assert controller.healthy() is False
    assert [s.alive for s in controller.worker_states()] == [True, False]
    with pytest.raises(WorkerUnavailable, match=r"^DP worker 1 is not available: it (died|is restarting after it died) \("):
        await collect(controller, GenerateMsg("after", GREEDY, prompt="a"), 1)
    assert controller.pick_rank(None, None) == 0  # dispatch skips the dead worker


async def test_cache_aware_sends_a_shared_prefix_to_the_same_worker_over_http():
    config = ServerConfig(dp_size=2, port=0, load_balance_method="cache_aware")
    async with DPController(config, ENGINE) as c, api_client(c) as client:
        ranks = []
        for prompt in ("a long shared system prompt, then: one", "hi", "a long shared system prompt, then: two"):
            resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
            assert resp.status == 200
            ranks.append((await resp.json())["dp_rank"])
        metrics = (await (await client.get("/metrics")).text()).splitlines()
    assert ranks == [0, 1, 0]
    assert "disagg_dp_cache_hits_total 1.0" in metrics and "disagg_dp_cache_misses_total 2.0" in metrics
