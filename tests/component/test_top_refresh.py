"""`disagg top` when the URL it watches stops answering /server_info (a router restarting): the
servers it named last are still shown under a line that says so; with --once and nothing known
yet it exits 1 naming the failure. A fake server on 127.0.0.1 (port 0)."""

import asyncio
import io
import socket

import pytest
from aiohttp import web

from disagg.top import run
from fake_engine import wait_for

pytestmark = pytest.mark.timeout(30)
CLEAR = "\x1b[H\x1b[2J"  # what starts each live screen
METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 0.0
"""


async def test_a_router_that_stops_answering_keeps_its_servers_on_screen():
    infos = []

    async def server_info(request: web.Request) -> web.Response:
        infos.append(1)
        if len(infos) == 1:
            return web.json_response({"disaggregation_mode": "decode"})
        return web.Response(status=500, text="not json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    out = io.StringIO()
    task = asyncio.create_task(run(url, 0.05, once=False, out=out))
    try:
        await wait_for(lambda: out.getvalue().count(CLEAR) >= 2)  # each screen is one write
    finally:
        task.cancel()
        await runner.cleanup()
    screens = [s for s in out.getvalue().split(CLEAR) if s]
    first, second = screens[0].splitlines(), screens[1].splitlines()
    assert first[0] == second[0] == f"disagg top {url} (every 0.05 s)"
    assert second[1] == f"{url}/server_info unreachable: JSONDecodeError"
    assert [line.split()[:3] for line in first[2:]] == [[url, "decode", "0"], [url, "decode", "1"]]
    assert [line.split()[:3] for line in second[3:]] == [[url, "decode", "0"], [url, "decode", "1"]]


async def test_once_with_nothing_known_exits_1_naming_the_failure():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = io.StringIO()
    assert await run(f"http://127.0.0.1:{port}", 1.0, once=True, out=out) == 1
    assert out.getvalue() == f"http://127.0.0.1:{port}/server_info unreachable: ClientConnectorError\n"
