"""The registry's write routes under a cluster secret (a proof answering one of its challenges, once,
for this registry, this method, path and body), and a bootstrap client that never echoes a remote
body (a decode reaches whatever bootstrap_host a request names). Real HTTP on 127.0.0.1:0."""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from bootstrap.client import (
    BootstrapClient, BootstrapInvalidAnswer, BootstrapRejected, BootstrapTimeout, BootstrapUnavailable,
)
from bootstrap.server import BootstrapServer
from disagg.registry_config import BootstrapClientConfig, BootstrapConfig, RetryConfig
from disagg.wire.auth import REGISTRY, Binding, answer, parse_proof, request_digest
from disagg.wire.bootstrap_msgs import RankRegistrationMsg
from disagg.wire.headers import CLUSTER_AUTH_HEADER

pytestmark = pytest.mark.timeout(30)

SECRET = "registry-secret"
FAST = BootstrapClientConfig(request_timeout_s=2.0, deadline_s=5.0,
                             retry=RetryConfig(initial_backoff_s=0.01, max_backoff_s=0.05))
RANK = RankRegistrationMsg(dp_rank=0, dp_size=1, rank_ip="127.0.0.1", rank_port=7000, page_size=16,
                           kv_cache_dtype="bfloat16", transfer_backend="tcp", agent_name="p0")
PUT_BODY = {"rank_ip": "127.0.0.1", "rank_port": 7000, "page_size": 16, "kv_cache_dtype": "bfloat16"}
TOPOLOGY = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}


CHALLENGE = 'X-Disagg-Cluster-Auth challenge="/challenge"'
USED = "cluster secret proof was already used: this registry accepts each answer once"


def refusal(method: str, path: str, reason: str) -> dict:
    return {"error": f"{method} {path} needs a cluster secret proof in X-Disagg-Cluster-Auth (see GET /challenge): "
                     f"{reason}"}


@pytest.fixture
async def guarded():
    seen: list[tuple[str, str, str | None, str | None]] = []

    async def record(request, response):
        seen.append((request.method, request.path, request.headers.get("Authorization"),
                     request.headers.get(CLUSTER_AUTH_HEADER)))

    server = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0, cluster_secret=SECRET))
    server.app.on_response_prepare.append(record)
    async with server:
        server.seen = seen
        yield server


async def call(method, url, **kw):
    async with aiohttp.ClientSession() as http, http.request(method, url, **kw) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers.get("WWW-Authenticate")


async def nonce_of(server) -> bytes:
    status, body, _ = await call("GET", server.url + "/challenge")
    assert status == 200 and sorted(body) == ["expires_in_s", "nonce"] and body["expires_in_s"] == 10.0
    return bytes.fromhex(body["nonce"])


async def proved(server, method: str, path: str, body: dict, *, secret: str = SECRET, target: str | None = None,
                 writer: str = "p0") -> dict:
    """The request arguments of a write carrying a proof made for `target` (default: the server)."""
    data = json.dumps(body).encode()
    binding = Binding(await nonce_of(server), b"c" * 32, writer, target or f"127.0.0.1:{server.port}",
                      request_digest(method, path, data))
    return {"data": data, "headers": {CLUSTER_AUTH_HEADER: answer(secret, REGISTRY, binding),
                                      "Content-Type": "application/json"}}


@pytest.mark.parametrize("method, path, body, ok", [
    ("PUT", "/route", PUT_BODY, {"status": "ok", "registration": "new", "num_registered": 1, "num_expected": 1}),
    ("POST", "/register_dp_rank", {"bootstrap_room": 5, "dp_rank": 0}, {"status": "ok"}),
])
async def test_write_routes_need_a_proof_of_the_cluster_secret(guarded, method, path, body, ok):
    url = guarded.url + path
    with capture_logs() as logs:
        assert await call(method, url, json=body) == (401, refusal(method, path, "no proof sent"), CHALLENGE)
        # The secret itself as a bearer (what writes carried before) is no proof.
        assert await call(method, url, json=body, headers={"Authorization": f"Bearer {SECRET}"}) == (
            401, refusal(method, path, "no proof sent"), CHALLENGE)
        assert await call(method, url, **await proved(guarded, method, path, body, secret="wrong")) == (
            401, refusal(method, path, "cluster secret mismatch"), CHALLENGE)
        assert await call(method, url, json=body, headers={CLUSTER_AUTH_HEADER: SECRET}) == (
            401, refusal(method, path, "malformed cluster secret proof"), CHALLENGE)
    assert [(e["event"], e["reason"]) for e in logs] == [
        ("registry write refused", reason) for reason in ("no proof sent", "no proof sent", "cluster secret mismatch",
                                                          "malformed cluster secret proof")]
    assert guarded.registry.num_registered == 0 and guarded.registry.query_rooms([5], 0.0) == {}
    assert await call(method, url, **await proved(guarded, method, path, body)) == (200, ok, None)


async def test_a_replayed_write_is_refused():
    """The same proof twice: the second is refused, and its write never applied."""
    clock = [0.0]
    config = BootstrapConfig(host="127.0.0.1", port=0, cluster_secret=SECRET, room_ttl_s=1000)
    async with BootstrapServer(config, clock=lambda: clock[0]) as server:
        url = server.url + "/register_dp_rank"
        first = await proved(server, "POST", "/register_dp_rank", {"bootstrap_room": 5, "dp_rank": 0})
        assert await call("POST", url, **first) == (200, {"status": "ok"}, None)
        server.registry.register_room(5, 0, -2000.0)  # gone: only a replay could bring it back
        with capture_logs() as logs:
            assert await call("POST", url, **first) == (401, refusal("POST", "/register_dp_rank", USED), CHALLENGE)
        assert [(e["event"], e["reason"]) for e in logs] == [("registry write refused", USED)]
        assert server.registry.query_rooms([5], 0.0) == {}
        late = await proved(server, "POST", "/register_dp_rank", {"bootstrap_room": 6, "dp_rank": 0})
        clock[0] += 10.0  # challenge_ttl_s
        assert await call("POST", url, **late) == (401, refusal(
            "POST", "/register_dp_rank",
            "cluster secret proof answers no live challenge of this registry (unknown or expired nonce)"), CHALLENGE)
        assert server.registry.query_rooms([6], clock[0]) == {}


async def test_a_write_proof_is_bound_to_its_registry_route_and_body(guarded):
    """Made for registry A, or for another route or body, a proof is refused: nothing is applied."""
    room5 = {"bootstrap_room": 5, "dp_rank": 0}
    async with BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0, cluster_secret=SECRET)) as other:
        for_other = await proved(guarded, "POST", "/register_dp_rank", room5, target=f"127.0.0.1:{other.port}")
        assert await call("POST", guarded.url + "/register_dp_rank", **for_other) == (401, refusal(
            "POST", "/register_dp_rank",
            f"cluster secret proof was made for 127.0.0.1:{other.port}, this registry is 127.0.0.1:{guarded.port}"),
            CHALLENGE)
    moved = await proved(guarded, "POST", "/register_dp_rank", room5)
    moved["data"] = json.dumps({"bootstrap_room": 6, "dp_rank": 0}).encode()
    assert await call("POST", guarded.url + "/register_dp_rank", **moved) == (
        401, refusal("POST", "/register_dp_rank", "cluster secret mismatch"), CHALLENGE)
    other_route = await proved(guarded, "PUT", "/route", room5)
    assert await call("POST", guarded.url + "/register_dp_rank", **other_route) == (
        401, refusal("POST", "/register_dp_rank", "cluster secret mismatch"), CHALLENGE)
    assert guarded.registry.query_rooms([5, 6], 0.0) == {}


async def test_read_routes_stay_open(guarded):
    await call("PUT", guarded.url + "/route", **await proved(guarded, "PUT", "/route", PUT_BODY))
    await call("POST", guarded.url + "/register_dp_rank",
               **await proved(guarded, "POST", "/register_dp_rank", {"bootstrap_room": 5, "dp_rank": 0}))
    assert await call("GET", guarded.url + "/route", params=TOPOLOGY) == (200, {
        "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 16,
        "kv_cache_dtype": "bfloat16", "follow_bootstrap_room": True}, None)
    assert await call("POST", guarded.url + "/query_dp_ranks", json={"bootstrap_rooms": [5, 6]}) == (200, {"5": 0}, None)
    async with aiohttp.ClientSession() as http, http.get(guarded.url + "/health") as resp:
        assert (resp.status, await resp.text()) == (200, "OK")


async def test_the_client_proves_the_secret_on_writes_only_and_never_sends_it(guarded):
    async with BootstrapClient("127.0.0.1", guarded.port, FAST, cluster_secret=SECRET, identity="p0") as client:
        await client.register_rank(RANK)
        await client.register_dp_rank(9, 0)
        assert (await client.get_topology()).dp_size == 1
        assert await client.query_dp_ranks([9]) == {9: 0}
    assert [(method, path, bearer, proof is not None) for method, path, bearer, proof in guarded.seen] == [
        ("GET", "/challenge", None, False), ("PUT", "/route", None, True),
        ("GET", "/challenge", None, False), ("POST", "/register_dp_rank", None, True),
        ("GET", "/route", None, False), ("POST", "/query_dp_ranks", None, False)]
    for _, _, _, proof in (guarded.seen[1], guarded.seen[3]):
        binding, _ = parse_proof(proof)
        assert (binding.client, binding.target) == ("p0", f"127.0.0.1:{guarded.port}") and SECRET not in proof


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
        answers["calls"] = answers.get("calls", 0) + 1
        status, body, content_type = answers["route"]
        if answers.get("hang_after") is not None and answers["calls"] > answers["hang_after"]:
            await asyncio.sleep(1.0)  # no answer within the client's deadline
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


async def test_an_attempt_cut_by_the_deadline_leaves_the_last_answer_in_the_error(foreign):
    """A 503, then no answer: the second attempt is cut by the call's 0.3 s deadline (its request timeout is
    2 s), so the error names what the server said last, not the cut."""
    port, answers = foreign
    answers.update(route=(503, INTERNAL, "text/plain"), hang_after=1)
    async with BootstrapClient("127.0.0.1", port, FAST) as client:
        with pytest.raises(BootstrapTimeout) as info:
            await client.get_topology(deadline_s=0.3)
    assert answers["calls"] == 2
    assert str(info.value).endswith(" 2 attempts; last: HTTP 503)") and INTERNAL not in str(info.value)


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
