"""The registry's write routes under a cluster secret, and a bootstrap client that never echoes a
remote body (a decode reaches whatever bootstrap_host a request names). Real HTTP on 127.0.0.1:0."""

import asyncio

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from bootstrap.client import (
    BootstrapClient, BootstrapInvalidAnswer, BootstrapRejected, BootstrapTimeout, BootstrapUnavailable,
)
from bootstrap.server import BootstrapServer
from disagg.config import BootstrapClientConfig, BootstrapConfig, RetryConfig
from disagg.wire.bootstrap_msgs import RankRegistrationMsg

pytestmark = pytest.mark.timeout(30)

SECRET = "registry-secret"
FAST = BootstrapClientConfig(request_timeout_s=2.0, deadline_s=5.0,
                             retry=RetryConfig(initial_backoff_s=0.01, max_backoff_s=0.05))
RANK = RankRegistrationMsg(dp_rank=0, dp_size=1, rank_ip="127.0.0.1", rank_port=7000, page_size=16,
                           kv_cache_dtype="bfloat16", transfer_backend="tcp", agent_name="p0")
PUT_BODY = {"rank_ip": "127.0.0.1", "rank_port": 7000, "page_size": 16, "kv_cache_dtype": "bfloat16"}
TOPOLOGY = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}


def refusal(method: str, path: str) -> dict:
    return {"error": f"{method} {path} needs 'Authorization: Bearer <cluster secret>': missing or wrong cluster secret"}


@pytest.fixture
async def guarded():
    seen: list[tuple[str, str, str | None]] = []

    async def record(request, response):
        seen.append((request.method, request.path, request.headers.get("Authorization")))

    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0, cluster_secret=SECRET))
    server.app.on_response_prepare.append(record)
    async with server:
        server.seen = seen
        yield server


async def call(method, url, **kw):
    async with aiohttp.ClientSession() as http, http.request(method, url, **kw) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers.get("WWW-Authenticate")


@pytest.mark.parametrize("method, path, body, ok", [
    ("PUT", "/route", PUT_BODY, {"status": "ok", "registration": "new", "num_registered": 1, "num_expected": 1}),
    ("POST", "/register_dp_rank", {"bootstrap_room": 5, "dp_rank": 0}, {"status": "ok"}),
])
async def test_write_routes_need_the_cluster_secret(guarded, method, path, body, ok):
    url = guarded.url + path
    with capture_logs() as logs:
        assert await call(method, url, json=body) == (401, refusal(method, path), "Bearer")
        assert await call(method, url, json=body, headers={"Authorization": "Bearer wrong"}) == (
            401, refusal(method, path), "Bearer")
        assert await call(method, url, json=body, headers={"Authorization": SECRET}) == (
            401, refusal(method, path), "Bearer")
    assert [e["event"] for e in logs] == ["registry write refused"] * 3
    assert guarded.registry.num_registered == 0 and guarded.registry.query_rooms([5], 0.0) == {}
    assert await call(method, url, json=body, headers={"Authorization": f"Bearer {SECRET}"}) == (200, ok, None)


async def test_read_routes_stay_open(guarded):
    await call("PUT", guarded.url + "/route", json=PUT_BODY, headers={"Authorization": f"Bearer {SECRET}"})
    await call("POST", guarded.url + "/register_dp_rank", json={"bootstrap_room": 5, "dp_rank": 0},
               headers={"Authorization": f"Bearer {SECRET}"})
    assert await call("GET", guarded.url + "/route", params=TOPOLOGY) == (200, {
        "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16,
        "kv_cache_dtype": "bfloat16", "follow_bootstrap_room": True}, None)
    assert await call("POST", guarded.url + "/query_dp_ranks", json={"bootstrap_rooms": [5, 6]}) == (200, {"5": 0}, None)
    async with aiohttp.ClientSession() as http, http.get(guarded.url + "/health") as resp:
        assert (resp.status, await resp.text()) == (200, "OK")


async def test_the_client_sends_the_secret_on_writes_only(guarded):
    async with BootstrapClient("127.0.0.1", guarded.port, FAST, cluster_secret=SECRET) as client:
        await client.register_rank(RANK)
        await client.register_dp_rank(9, 0)
        assert (await client.get_topology()).dp_size == 1
        assert await client.query_dp_ranks([9]) == {9: 0}
    bearer = f"Bearer {SECRET}"
    assert guarded.seen == [("PUT", "/route", bearer), ("POST", "/register_dp_rank", bearer),
                            ("GET", "/route", None), ("POST", "/query_dp_ranks", None)]


@pytest.mark.parametrize("secret", [None, "wrong"])
async def test_a_client_without_the_secret_is_refused_at_once_with_a_hint(guarded, secret):
    async with BootstrapClient("127.0.0.1", guarded.port, FAST, cluster_secret=secret) as client:
        with pytest.raises(BootstrapRejected) as info:
            await client.register_rank(RANK)
    assert str(info.value) == (f"bootstrap server 127.0.0.1:{guarded.port} answered 401 to PUT /route: "
                               "the cluster secret is missing or differs from the registry's")
    assert info.value.status == 401 and guarded.registry.num_registered == 0


INTERNAL = "internal-only text: db password hunter2"


@pytest.fixture
async def foreign():
    """Some other HTTP service a request could point a decode at."""
    answers = {}

    async def route(request):
        status, body, content_type = answers["route"]
        return web.Response(status=status, text=body, content_type=content_type)

    app = web.Application()
    app.router.add_get("/route", route)
    app.router.add_post("/query_dp_ranks", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield runner.addresses[0][1], answers
    await runner.cleanup()


@pytest.mark.parametrize("status, content_type", [(404, "text/plain"), (403, "application/json"), (400, "text/html")])
async def test_a_refusal_names_host_port_and_status_and_never_the_remote_body(foreign, status, content_type):
    port, answers = foreign
    answers["route"] = (status, f'{{"error": "{INTERNAL}"}}' if "json" in content_type else INTERNAL, content_type)
    async with BootstrapClient("127.0.0.1", port, FAST) as client:
        with pytest.raises(BootstrapRejected) as info:
            await client.get_topology()
    assert str(info.value) == f"bootstrap server 127.0.0.1:{port} answered {status} to GET /route"
    assert INTERNAL in info.value.detail  # kept for the log, never in the message


async def test_a_non_registry_200_or_503_never_echoes_the_body(foreign):
    port, answers = foreign
    answers["route"] = (200, f"<html>{INTERNAL}</html>", "text/html")
    async with BootstrapClient("127.0.0.1", port, FAST) as client:
        with pytest.raises(BootstrapInvalidAnswer) as info:
            await client.get_topology()
        assert str(info.value) == (f"bootstrap server 127.0.0.1:{port} answered 200 to GET /route with a body "
                                   "that is not a TopologyMsg")
        answers["route"] = (200, f'{{"{INTERNAL}": 1}}', "application/json")
        with pytest.raises(BootstrapInvalidAnswer) as info:
            await client.query_dp_ranks([1])
        assert str(info.value) == (f"bootstrap server 127.0.0.1:{port} answered 200 to POST /query_dp_ranks with a "
                                   "body that is not a room map")
        answers["route"] = (503, INTERNAL, "text/plain")
        with pytest.raises(BootstrapTimeout) as info:
            await client.get_topology(deadline_s=0.2)
    assert str(info.value).endswith(" attempts; last: HTTP 503)") and INTERNAL not in str(info.value)


async def test_a_non_http_banner_never_reaches_the_error():
    async def banner(reader, writer):
        writer.write(f"SSH-2.0-OpenSSH_9.6 {INTERNAL}\r\n".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(banner, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, BootstrapClient("127.0.0.1", port, FAST) as client:
        # The deadline ends either in a backoff (the last attempt's garbage answer) or mid-attempt
        # (a timeout), depending on the machine's load; the banner's text never appears either way.
        with pytest.raises((BootstrapUnavailable, BootstrapTimeout)) as info:
            await client.get_topology(deadline_s=0.2)
    text = str(info.value)
    assert text.startswith(f"bootstrap server http://127.0.0.1:{port}: GET /route got no answer within 0.2 s")
    assert text.endswith(("; last: ClientResponseError)", "; last: request timed out)")) and INTERNAL not in text
