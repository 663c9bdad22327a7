"""Our router's planner (`--planner advisory|auto`) against fake servers that report step counters on
/metrics and may switch roles: it exports its estimates and decisions on the router's /metrics, and in
auto mode switches one prefill to decode once the same proposal came twice."""

import asyncio

import aiohttp
import pytest
from aiohttp import web

from disagg.router.config import PlannerConfig, PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class SwitchableFake:
    """A server with --enable-pd-role-switch: each /metrics read adds `steps` steps of `step_s` each."""

    def __init__(self, mode: str, steps: int, step_s: float):
        self.mode, self.steps, self.step_s = mode, steps, step_s
        self.count = self.wall = 0.0
        self.switches: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/pd_role_switch", self._switch)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _health(self, request):
        return web.Response(status=200)

    async def _server_info(self, request):
        return web.json_response({"dp_size": 1, "disaggregation_mode": self.mode, "pd_role_epoch": len(self.switches)})

    async def _metrics(self, request):
        self.count += self.steps
        self.wall += self.steps * self.step_s
        return web.Response(text=f'disagg_engine_step_seconds_count{{dp_rank="0"}} {self.count}\n'
                                 f'disagg_engine_step_seconds_sum{{dp_rank="0"}} {self.wall}\n'
                                 'disagg_engine_step_waiting{dp_rank="0"} 0.0\n')

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


async def test_advisory_estimates_and_proposes_and_switches_nothing():
    prefills, decode, metrics, _ = await planned("advisory", 1.5)
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
