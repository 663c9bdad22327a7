"""Our router's planner (`--planner advisory|auto`) against fake servers that report step counters on
/metrics and may switch roles: it exports its estimates and decisions on the router's /metrics, and in
auto mode switches one prefill to decode once the same proposal came twice."""

import asyncio
import re

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from disagg.router.config import PlannerConfig, PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class SwitchableFake:
    """A server with --enable-pd-role-switch: each /metrics read adds `steps` steps of `step_s` each."""

    def __init__(self, mode: str, steps: int, step_s: float, tokens_per_step: int = 0, local_limit: int = 0):
        self.mode, self.steps, self.step_s = mode, steps, step_s
        self.tokens_per_step, self.local_limit = tokens_per_step, local_limit  # prompt tokens a step; a decode's limit
        self.count = self.wall = self.tokens = 0.0
        self.generate_status = 200  # what /v1/completions answers (429: admission turns it away)
        self.generate_bodies: list[dict] = []
        self.switches: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/pd_role_switch", self._switch)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _health(self, request):
        return web.Response(status=200)

    async def _server_info(self, request):
        info = {"dp_size": 1, "disaggregation_mode": self.mode, "pd_role_epoch": len(self.switches)}
        if self.mode == "decode" and self.local_limit:
            info["max_local_prefill_tokens"] = self.local_limit
        return web.json_response(info)

    async def _metrics(self, request):
        self.count += self.steps
        self.wall += self.steps * self.step_s
        self.tokens += self.steps * self.tokens_per_step
        return web.Response(text=f'disagg_engine_step_seconds_count{{dp_rank="0"}} {self.count}\n'
                                 f'disagg_engine_step_seconds_sum{{dp_rank="0"}} {self.wall}\n'
                                 f'disagg_engine_step_prefill_tokens_sum{{dp_rank="0"}} {self.tokens}\n'
                                 'disagg_engine_step_waiting{dp_rank="0"} 0.0\n')

    async def _completions(self, request):
        self.generate_bodies.append(await request.json())
        if self.generate_status == 429:
            return web.json_response({"error": {"message": "too many requests waiting", "type": "RateLimitError",
                                                "param": None, "code": 429}}, status=429)
        return web.json_response({"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

    async def _switch(self, request):
        body = await request.json()
        self.switches.append(body)
        self.mode = body["new_role"]
        return web.json_response({"success": True, "switched": True, "disaggregation_mode": self.mode,
                                  "pd_role_epoch": len(self.switches)})


async def planned(mode: str, wait_s: float):
    prefills = [SwitchableFake("prefill", 1, 0.01), SwitchableFake("prefill", 1, 0.01)]
    decode = SwitchableFake("decode", 20, 0.1)  # steps of 100 ms: ITL over 60 ms
    for fake in (*prefills, decode):
        await fake.start()
    config = RouterConfig(host="127.0.0.1", port=0, health_check_interval_s=0.2, role_poll_interval_s=0.1,
                          prefill=tuple(PrefillEndpoint(p.url, 8998) for p in prefills), decode=(decode.url,),
                          planning=PlannerConfig(planner=mode, planner_interval_s=0.2, itl_slo_ms=60.0))
    async with RouterServer(config) as router, aiohttp.ClientSession() as http:
        await asyncio.sleep(wait_s)
        async with http.get(router.url + "/metrics") as r:
            metrics = await r.text()
        async with http.get(router.url + "/workers") as r:
            workers = await r.json()
    for fake in (*prefills, decode):
        await fake.runner.cleanup()
    return prefills, decode, metrics, workers


def lines(metrics: str, prefix: str) -> list[str]:
    return sorted(line for line in metrics.splitlines() if line.startswith(prefix))


async def whole_local_config(prefill: SwitchableFake, decode: SwitchableFake, interval_s: float) -> RouterConfig:
    """Both fakes started; our router with cache_aware (whole requests to decodes that prefill locally)
    and the planner in auto mode."""
    for fake in (prefill, decode):
        await fake.start()
    return RouterConfig(host="127.0.0.1", port=0, policy="cache_aware", health_check_interval_s=0.2,
                        role_poll_interval_s=0.1, prefill=(PrefillEndpoint(prefill.url, 8998),), decode=(decode.url,),
                        planning=PlannerConfig(planner="auto", planner_interval_s=interval_s))


async def first_switch(prefill: SwitchableFake) -> None:
    """Until the planner switched the prefill (10 s at most)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while not prefill.switches:
        assert loop.time() < deadline, "the planner moved nothing in 10 s"
        await asyncio.sleep(0.05)


async def test_advisory_estimates_and_proposes_and_switches_nothing():
    with capture_logs() as logs:
        prefills, decode, metrics, _ = await planned("advisory", 1.5)
    said = [e for e in logs if e["event"] == "planner decision"]
    # Each interval per role on the decision's log line (a read adds 1 step to a prefill, 20 to the decode; the two
    # prefills may be read unequally often, so their sum is only positive).
    assert said and {(e["action"], e["rejected"]) for e in said} == {("prefill_to_decode", 0)}
    idle = {"in_flight": 0, "prompt_tokens": 0, "decode_seqs_a_step": 0.0, "waiting": 0}
    for e in said:
        steps = (e["prefill"].pop("steps"), e["decode"].pop("steps"))
        assert steps[0] > 0 and steps[1] > 0 and steps[1] % 20 == 0, steps
        assert (e["prefill"], e["decode"]) == ({"servers": 2, "step_ms": 10.0, **idle},
                                               {"servers": 1, "step_ms": 100.0, **idle})
    assert [p.switches for p in prefills] == [[], []]
    assert lines(metrics, "disagg_planner_estimated_itl_seconds ") == ["disagg_planner_estimated_itl_seconds 0.1"]
    predicted = {line.split()[0]: round(float(line.split()[1]), 9) for line in lines(metrics, "disagg_planner_predicted")}
    assert predicted == {'disagg_planner_predicted_seconds{metric="itl"}': 0.05,
                         'disagg_planner_predicted_seconds{metric="ttft"}': 0.02}
    assert lines(metrics, "disagg_planner_servers") == ['disagg_planner_servers{role="decode"} 2.0',
                                                        'disagg_planner_servers{role="prefill"} 1.0']
    reason = "ITL 100 ms over its 60 ms objective; with one more decode: ITL 50 ms, TTFT 20 ms"
    assert lines(metrics, "disagg_planner_last_decision{") == [
        f'disagg_planner_last_decision{{action="prefill_to_decode",reason="{reason}"}} 1.0']


async def test_auto_switches_one_prefill_to_decode_and_the_router_follows():
    prefills, decode, metrics, workers = await planned("auto", 1.5)
    assert [p.switches for p in prefills] == [[{"new_role": "decode"}], []]  # one, the first of the least busy
    assert sorted(w["url"] for w in workers["decode"] if not w.get("draining")) == sorted([prefills[0].url, decode.url])
    assert [w["url"] for w in workers["prefill"] if not w.get("draining")] == [prefills[1].url]
    assert 'disagg_planner_decisions_total{action="prefill_to_decode",confirmed="true"} 1.0' in metrics


RETURN_FOR_429S = (429, 0.08, r'429s with no prefill \(\d+\.\d\d a second lately\) and ITL \d+ ms over its 60 ms '
                   r'objective \(.*\): a decode becomes the prefill')
RETURN_FOR_SLOW_STEPS = (200, 0.15, r'ITL \d+ ms lately with no prefill, over 1\.5 times its 60 ms objective \(.*\): '
                         r'a decode becomes the prefill')


@pytest.mark.parametrize("status, step_s, reason", [RETURN_FOR_429S, RETURN_FOR_SLOW_STEPS], ids=["429s", "slow"])
async def test_auto_moves_a_light_last_prefill_to_decode_and_back_when_the_decodes_fall_behind(status, step_s, reason):
    """cache_aware with decodes that prefill locally: the one prefill steps half the time (a prompt load
    of 0.5, at most 1), so auto makes it a decode and requests go whole to the decodes
    (disagg_prefill_here); the prefill comes back (the server it made a decode, not the other) once the
    decodes answer 429 and step slower than the ITL objective (80 ms: under 1.5 times it, so the 429s
    bring it), or with no 429 once their steps lately are over 1.5 times it (150 ms)."""
    prefill = SwitchableFake("prefill", 2, 0.05, tokens_per_step=100, local_limit=192)  # 0.1 s of each 0.2 s
    decode = SwitchableFake("decode", 20, 0.02, local_limit=192)
    config = await whole_local_config(prefill, decode, 0.2)
    body = {"model": "m", "prompt": "Hello there " * 100, "max_tokens": 4}
    try:
        async with RouterServer(config) as router, aiohttp.ClientSession() as http:
            await first_switch(prefill)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            assert prefill.switches == [{"new_role": "decode"}]
            while prefill.url not in [w["url"] for w in (await (await http.get(router.url + "/workers")).json())["decode"]]:
                assert loop.time() < deadline, "the router did not follow the switch"
                await asyncio.sleep(0.05)
            async with http.post(router.url + "/v1/completions", json=body) as r:
                assert (r.status, r.headers["X-Disagg-Path-Reason"]) == (200, "no_prefill_server")
            sent = prefill.generate_bodies + decode.generate_bodies
            assert [b.get("disagg_prefill_here") for b in sent] == [True]
            prefill.generate_status = decode.generate_status = status
            prefill.step_s = decode.step_s = step_s  # their steps slow past the 60 ms objective
            while len(prefill.switches) < 2:
                assert loop.time() < deadline + 10, "nothing brought the prefill back"
                async with http.post(router.url + "/v1/completions", json=body) as r:
                    assert r.status == status
                await asyncio.sleep(0.05)
            assert (prefill.switches, decode.switches) == ([{"new_role": "decode"}, {"new_role": "prefill"}], [])
            async with http.get(router.url + "/metrics") as r:
                metrics = await r.text()
            assert 'disagg_planner_decisions_total{action="decode_to_prefill",confirmed="true"} 1.0' in metrics
            reasons = [line for line in lines(metrics, "disagg_planner_last_decision{")]
            assert len(reasons) == 1 and re.fullmatch(
                r'disagg_planner_last_decision\{action="decode_to_prefill",reason="' + reason + r'"\} 1\.0',
                reasons[0]), reasons
    finally:
        for fake in (prefill, decode):
            await fake.runner.cleanup()


async def test_auto_starts_a_cluster_that_saw_no_prompt_with_no_prefill_at_the_first_decision():
    """cache_aware with decodes that prefill locally, nothing served yet: at its first decision the
    planner makes the one prefill a decode, with no confirming interval."""
    prefill = SwitchableFake("prefill", 0, 0.0, local_limit=192)
    decode = SwitchableFake("decode", 0, 0.0, local_limit=192)
    config = await whole_local_config(prefill, decode, 1.0)
    try:
        async with RouterServer(config) as router, aiohttp.ClientSession() as http:
            await first_switch(prefill)
            async with http.get(router.url + "/metrics") as r:
                metrics = await r.text()
    finally:
        for fake in (prefill, decode):
            await fake.runner.cleanup()
    assert (prefill.switches, decode.switches) == ([{"new_role": "decode"}], [])
    assert 'disagg_planner_decisions_total{action="prefill_to_decode",confirmed="true"} 1.0' in metrics
    assert 'disagg_planner_decisions_total{action="prefill_to_decode",confirmed="false"}' not in metrics
    reason = "no prompt seen yet: the prefill becomes a decode, every server prefills its own requests"
    assert lines(metrics, "disagg_planner_last_decision{") == [
        f'disagg_planner_last_decision{{action="prefill_to_decode",reason="{reason}"}} 1.0']
