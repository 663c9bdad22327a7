"""disagg.http_site.start_site over real sockets on 127.0.0.1: the bound port, and a failed bind that cleans up."""

import errno
import socket

import aiohttp
import pytest
from aiohttp import web

from disagg.http_site import start_site

pytestmark = pytest.mark.timeout(30)


async def ping(_request: web.Request) -> web.Response:
    return web.Response(text="pong")


def _app(cleaned: list[str]) -> web.Application:
    app = web.Application()
    app.router.add_get("/ping", ping)

    async def on_cleanup(_app):
        cleaned.append("cleaned")

    app.on_cleanup.append(on_cleanup)
    return app


async def test_port_zero_binds_a_free_port_and_serves_until_cleanup():
    cleaned: list[str] = []
    runner, port = await start_site(_app(cleaned), "127.0.0.1", 0, access_log=None)
    assert port > 0
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/ping") as resp:
            assert (resp.status, await resp.text()) == (200, "pong")
    await runner.cleanup()
    assert cleaned == ["cleaned"]


async def test_a_taken_port_raises_and_the_runner_is_cleaned_up():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cleaned: list[str] = []
        with pytest.raises(OSError) as info:
            await start_site(_app(cleaned), "127.0.0.1", taken.getsockname()[1])
        assert info.value.errno == errno.EADDRINUSE
        assert cleaned == ["cleaned"]
