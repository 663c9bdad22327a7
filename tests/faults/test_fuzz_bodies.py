"""Seeded fuzzing of request bodies against real servers with real engine workers: no answer is a 5xx,
every error is OpenAI-shaped, and afterwards every worker is alive, every KV block is free and a
greedy request gives the same tokens as before. Bodies and their checks: fuzz_bodies.py."""

from __future__ import annotations

import asyncio
import collections
import time

import aiohttp
import pytest
from fuzz_bodies import BodyFuzzer, Fuzzed, Route, check_answer, routes

from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig, with_settings
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from disagg.launch import start_server

pytestmark = pytest.mark.timeout(240)
ENGINE = EngineConfig(
    model=ModelConfig(model="tiny", dtype="float32", max_model_len=48),  # short: a default fills the context fast
    cache=CacheConfig(num_blocks=64, block_size=4),
    scheduler=SchedulerConfig(max_num_batched_tokens=32),
)
MAX_BODY_BYTES = 1 << 20
PROMPT_IDS = [5, 6, 7, 8]
GREEDY = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
TIMEOUT = aiohttp.ClientTimeout(total=60)


class FuzzRun:
    """Sends fuzzed requests `concurrency` at a time, 80% to the generate routes; a quiet route (sleep,
    wake_up, reset_prefix_cache) goes alone between batches, and a sleep that succeeded is woken up."""

    def __init__(self, session: aiohttp.ClientSession, url: str, fuzzer: BodyFuzzer, fuzzed_routes: list[Route]):
        self.session, self.url, self.fuzzer = session, url, fuzzer
        self.busy = [r for r in fuzzed_routes if r.generates]
        self.admin = [r for r in fuzzed_routes if not r.quiet and r not in self.busy]
        self.quiet = [r for r in fuzzed_routes if r.quiet]
        self.problems: list[str] = []
        self.statuses: collections.Counter = collections.Counter()

    def draw(self) -> Route:
        roll = self.fuzzer.rng.random()
        pool = self.busy if roll < 0.80 or not self.admin else self.admin if roll < 0.97 or not self.quiet else self.quiet
        return self.fuzzer.rng.choice(pool)

    async def run(self, count: int, concurrency: int) -> None:
        sent = 0
        while sent < count:
            batch, alone = [], []
            while len(batch) + len(alone) < concurrency and sent + len(batch) + len(alone) < count:
                route = self.draw()
                (alone if route.quiet else batch).append(self.fuzzer.request(route))
            await asyncio.gather(*(self.send(f) for f in batch))
            for fuzzed in alone:
                if await self.send(fuzzed) == 200 and fuzzed.route.path == "/sleep":
                    await self.wake_up()
            sent += len(batch) + len(alone)

    async def wake_up(self) -> None:
        async with self.session.post(self.url + "/wake_up") as resp:
            if resp.status != 200:
                self.problems.append(f"wake_up after a fuzzed sleep: {resp.status} {await resp.read()!r}")

    async def send(self, fuzzed: Fuzzed) -> int:
        url = self.url + fuzzed.route.path + (f"?{fuzzed.query}" if fuzzed.query else "")
        what = f"{fuzzed.route.method} {fuzzed.route.path} {fuzzed.body[:200]!r} headers={fuzzed.headers}"
        try:
            async with self.session.request(fuzzed.route.method, url, data=fuzzed.body, timeout=TIMEOUT,
                                            headers={"Content-Type": "application/json", **fuzzed.headers}) as resp:
                raw = await resp.read()
                status, content_type = resp.status, resp.headers.get("Content-Type", "")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.problems.append(f"{what}: {type(exc).__name__}: {exc}")
            return 0
        self.statuses[status] += 1
        self.problems += check_answer(status, content_type, raw, what)
        return status


async def greedy_ids(session: aiohttp.ClientSession, url: str, routed_dp_rank: int | None) -> list[int]:
    body = GREEDY if routed_dp_rank is None else {**GREEDY, "routed_dp_rank": routed_dp_rank}
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["output_ids"]


async def wait_all_blocks_free(stats, deadline_s: float = 15.0) -> list[dict]:
    """Every worker's stats once each has all its blocks free and nothing running (stats lag 0.5 s)."""
    deadline = time.monotonic() + deadline_s
    while True:
        states = await stats()
        if all(s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0 for s in states):
            return states
        assert time.monotonic() < deadline, f"blocks not freed: {states}"
        await asyncio.sleep(0.2)


def assert_no_traceback(capfd) -> None:
    """Workers log to the inherited stdout/stderr: a failed engine step (which would fail every request
    in its batch) or any other logged exception shows up there even when no answer was a 5xx."""
    out, err = capfd.readouterr()
    lines = (out + err).splitlines()
    bad = [i for i, line in enumerate(lines) if "Traceback" in line or "engine step failed" in line]
    assert bad == [], "\n".join(lines[bad[0]: bad[0] + 30])


async def test_fuzzed_bodies_on_a_unified_server_never_get_a_5xx(capfd):
    server = await start_server(ServerConfig(port=0, dp_size=2, load_balance_method="round_robin",
                                             max_body_bytes=MAX_BODY_BYTES), ENGINE, DisaggConfig(), lambda _: None)
    url = f"http://127.0.0.1:{server.port}"
    try:
        async with aiohttp.ClientSession() as session:
            before = [await greedy_ids(session, url, rank) for rank in (0, 1)]
            run = FuzzRun(session, url, BodyFuzzer(seed=20261123, max_string_chars=300_000), routes(PROMPT_IDS))
            started = time.monotonic()
            await run.run(count=3000, concurrency=8)
            elapsed_s = time.monotonic() - started
            assert run.problems == [], "\n".join(run.problems[:20])
            async with session.get(url + "/health") as resp:
                assert resp.status == 200
            async with session.get(url + "/server_info") as resp:
                states = (await resp.json())["internal_states"]
            assert [(s["dp_rank"], s["alive"], s["ready"]) for s in states] == [(0, True, True), (1, True, True)]
            stats = await wait_all_blocks_free(lambda: server.controller.call_utility("stats"))
            assert [s.num_free_blocks for s in stats] == [64, 64]
            assert [await greedy_ids(session, url, rank) for rank in (0, 1)] == before
    finally:
        await server.close()
    assert_no_traceback(capfd)
    assert sum(run.statuses.values()) >= 3000 and run.statuses[200] > 100 and run.statuses[400] > 500, run.statuses
    print(f"fuzzed {sum(run.statuses.values())} bodies in {elapsed_s:.1f} s: {dict(sorted(run.statuses.items()))}")


async def assert_pd_refuses_what_the_unified_engine_refuses(session: aiohttp.ClientSession, url: str) -> None:
    """Both legs refuse at admission (the prefill with the client's max_tokens, though it runs 1 token)."""
    cases = [
        ({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2**62}}, "max_tokens",
         f"This model's maximum context length is 48 tokens. However, you requested {3 + 2**62} tokens (3 in the "
         f"messages, {2**62} in the completion). Please reduce the length of the messages or completion."),
        ({"input_ids": [5, 6, 7], "sampling_params": {"min_new_tokens": 2, "stop_token_ids": [999999999]}},
         "stop_token_ids", "stop token id 999999999 is out of vocabulary (vocab_size=320)"),
    ]
    for body, param, message in cases:
        async with session.post(url + "/generate", json=body) as resp:
            assert (resp.status, await resp.json()) == (400, {"error": {
                "message": message, "type": "BadRequestError", "param": param, "code": None}})


async def test_fuzzed_bodies_through_the_router_to_a_pd_pair_never_get_a_5xx(capfd):
    disagg = with_settings(DisaggConfig(transfer_backend="tcp"), bootstrap_port=0, bootstrap_timeout_s=20, waiting_timeout_s=20)
    prefill, decode = await asyncio.gather(
        start_server(ServerConfig(port=0, dp_size=2, load_balance_method="follow_bootstrap_room",
                                  disaggregation_mode="prefill", max_body_bytes=MAX_BODY_BYTES), ENGINE, disagg, lambda _: None),
        start_server(ServerConfig(port=0, dp_size=1, disaggregation_mode="decode", max_body_bytes=MAX_BODY_BYTES),
                     ENGINE, disagg, lambda _: None),
    )
    config = RouterConfig(host="127.0.0.1", port=0, health_check_interval_s=0, request_timeout_s=60,
                          prefill=(PrefillEndpoint(f"http://127.0.0.1:{prefill.port}", prefill.bootstrap_port),),
                          decode=(f"http://127.0.0.1:{decode.port}",))
    try:
        async with RouterServer(config) as router, aiohttp.ClientSession() as session:
            before = await greedy_ids(session, router.url, None)
            await assert_pd_refuses_what_the_unified_engine_refuses(session, router.url)
            generate_routes = [r for r in routes(PROMPT_IDS, pd=True) if r.generates]
            run = FuzzRun(session, router.url, BodyFuzzer(seed=7, max_string_chars=300_000), generate_routes)
            started = time.monotonic()
            await run.run(count=600, concurrency=6)
            elapsed_s = time.monotonic() - started
            assert run.problems == [], "\n".join(run.problems[:20])
            for s in (prefill, decode):
                async with session.get(f"http://127.0.0.1:{s.port}/health") as resp:
                    assert resp.status == 200
                await wait_all_blocks_free(lambda s=s: s.controller.call_utility("stats"), deadline_s=30)
            assert await greedy_ids(session, router.url, None) == before
    finally:
        await asyncio.gather(prefill.close(), decode.close())
    assert_no_traceback(capfd)
    assert run.statuses[200] > 20 and run.statuses[400] > 100, run.statuses
    print(f"fuzzed {sum(run.statuses.values())} bodies through P/D in {elapsed_s:.1f} s: {dict(sorted(run.statuses.items()))}")
