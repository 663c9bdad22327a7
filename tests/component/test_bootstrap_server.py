"""Bootstrap server and client over real HTTP on 127.0.0.1 (port 0), with an injected clock."""

import asyncio
import signal
import socket
import sys
import time

import aiohttp
import pytest

from bootstrap.client import BootstrapClient, BootstrapRejected, BootstrapTimeout, BootstrapUnavailable
from bootstrap.server import BootstrapServer
from disagg.registry_config import BootstrapClientConfig, BootstrapConfig, RetryConfig
from disagg.wire.bootstrap_msgs import RankRegistrationMsg, TopologyMsg

pytestmark = pytest.mark.timeout(30)

SGLANG_TOPOLOGY = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}
LEGACY_TOPOLOGY = {"engine_rank": -1, "target_dp_group": -1, "target_pp_rank": -1}
FAST = BootstrapClientConfig(
    request_timeout_s=2.0, deadline_s=5.0, query_batch_window_s=0.02,
    retry=RetryConfig(initial_backoff_s=0.01, max_backoff_s=0.05),
)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def sglang_put_body(dp_rank: int, port: int, **extra) -> dict:
    """What current SGLang prefill ranks send (system DP, no DP attention)."""
    return {
        "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 2, "system_dp_rank": dp_rank, "rank_ip": "127.0.0.1", "rank_port": port,
        "page_size": 16, "kv_cache_dtype": "auto", "load_balance_method": "round_robin", **extra,
    }


@pytest.fixture
async def server():
    clock = FakeClock()
    srv = BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0, room_ttl_s=120.0), clock=clock)
    await srv.start()
    srv.clock = clock
    yield srv
    await srv.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


async def call(http, method, url, **kw):
    async with http.request(method, url, **kw) as resp:
        ctype = resp.headers.get("Content-Type", "")
        body = await resp.json() if ctype.startswith("application/json") else await resp.text()
        return resp.status, body


async def test_health_and_503_until_every_rank_registered(server, http):
    url = server.url
    assert await call(http, "GET", f"{url}/health") == (200, "OK")
    assert await call(http, "GET", f"{url}/route", params=SGLANG_TOPOLOGY) == (
        503, {"error": "prefill server not fully registered yet: 0 of an unknown number of ranks"})
    status, body = await call(http, "PUT", f"{url}/route", json=sglang_put_body(0, 7000, extra_field=[1]))
    assert (status, body) == (200, {"status": "ok", "registration": "new", "num_registered": 1, "num_expected": 2})
    assert await call(http, "GET", f"{url}/route", params=SGLANG_TOPOLOGY) == (
        503, {"error": "prefill server not fully registered yet: 1 of 2 ranks"})
    assert (await call(http, "PUT", f"{url}/route", json=sglang_put_body(1, 7001)))[0] == 200
    # Exactly SGLang's PrefillServerInfo fields: current SGLang decode builds it with **body.
    assert await call(http, "GET", f"{url}/route", params=SGLANG_TOPOLOGY) == (200, {
        "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 2, "pp_size": 1, "page_size": 16,
        "kv_cache_dtype": "auto", "follow_bootstrap_room": False,
    })
    assert await call(http, "GET", f"{url}/route", params=LEGACY_TOPOLOGY) == (200, {
        "prefill_attn_tp_size": 1, "prefill_dp_size": 2, "prefill_pp_size": 1,
        "dp_size": 2, "tp_size": 1, "pp_size": 1, "cp_size": 1, "page_size": 16, "kv_cache_dtype": "auto",
        "load_balance_method": "round_robin", "transfer_backend": None, "follow_bootstrap_room": False,
    })


async def test_rank_address_and_unknown_rank(server, http):
    url = server.url
    for dp in (0, 1):
        await call(http, "PUT", f"{url}/route", json=sglang_put_body(dp, 7000 + dp, agent_name=f"p{dp}"))
    one = {"prefill_dp_rank": 1, "prefill_cp_rank": 0, "target_tp_rank": 0, "target_pp_rank": 0}
    assert await call(http, "GET", f"{url}/route", params=one) == (200, {
        "rank_ip": "127.0.0.1", "rank_port": 7001, "dp_rank": 1, "tp_rank": 0, "pp_rank": 0,
        "cp_rank": 0, "agent_name": "p1", "transfer_backend": None,
    })
    legacy = {"engine_rank": 0, "target_dp_group": 0, "target_pp_rank": 0}
    assert (await call(http, "GET", f"{url}/route", params=legacy))[1]["rank_port"] == 7000
    assert await call(http, "GET", f"{url}/route", params=dict(one, prefill_dp_rank=5)) == (
        404, {"error": "unknown rank: dp_rank 5 is out of range for dp_size 2"})


async def test_restarted_rank_replaces_its_address_and_conflicts_are_409(server, http):
    url = server.url
    await call(http, "PUT", f"{url}/route", json=sglang_put_body(0, 7000))
    status, body = await call(http, "PUT", f"{url}/route", json=sglang_put_body(0, 7100))
    assert (status, body["registration"], body["num_registered"]) == (200, "replaced", 1)
    assert await call(http, "PUT", f"{url}/route", json=sglang_put_body(1, 7001, page_size=32)) == (
        409, {"error": "registration conflicts with the ranks already registered: page_size=32 (registered: 16)"})


@pytest.mark.parametrize(
    "method, path, kwargs, message",
    [
        ("PUT", "/route", {"data": b"{not json"},
         "invalid JSON body: JSON is malformed: object keys must be strings (byte 1)"),
        ("PUT", "/route", {"data": b""}, "invalid JSON body: Input data was truncated"),
        ("PUT", "/route", {"json": {"rank_port": 1}}, "invalid PUT /route body: Object missing required field `rank_ip`"),
        ("PUT", "/route", {"json": {"rank_ip": "h", "rank_port": 0}},
         "invalid PUT /route body: Expected `int` >= 1 - at `$.rank_port`"),
        ("PUT", "/route", {"json": {"rank_ip": "h", "rank_port": 1, "role": "Decode"}},
         "only role 'Prefill' registers ranks, got role 'Decode'"),
        ("PUT", "/route", {"json": sglang_put_body(2, 7000)}, "dp_rank 2 is out of range for dp_size 2"),
        ("GET", "/route", {}, "missing query parameters: send prefill_dp_rank, prefill_cp_rank, target_tp_rank "
                              "and target_pp_rank (or engine_rank, target_dp_group and target_pp_rank); all -1 "
                              "asks for the topology"),
        ("GET", "/route", {"params": {"engine_rank": "a", "target_dp_group": 0}},
         "query parameter engine_rank must be an integer, got 'a'"),
        ("POST", "/register_dp_rank", {"json": {"bootstrap_room": "abc", "dp_rank": 0}},
         "invalid POST /register_dp_rank body: Expected `int`, got `str` - at `$.bootstrap_room`"),
        ("POST", "/register_dp_rank", {"json": {"bootstrap_room": -5, "dp_rank": 0}},
         "invalid POST /register_dp_rank body: Expected `int` >= 0 - at `$.bootstrap_room`"),
        ("POST", "/query_dp_ranks", {"json": [1, 2]},
         "invalid POST /query_dp_ranks body: Expected `object`, got `array`"),
        ("POST", "/query_dp_ranks", {"json": {"bootstrap_rooms": 5}},
         "invalid POST /query_dp_ranks body: Expected `array`, got `int` - at `$.bootstrap_rooms`"),
        ("POST", "/register_dp_rank", {"data": b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"},
         "invalid JSON body: it is nested too deeply"),
        ("PUT", "/route", {"data": b'{"rank_ip": "\xff"}'}, "invalid JSON body: it is not valid UTF-8"),
    ],
)
async def test_malformed_requests_are_400_with_a_message(server, http, method, path, kwargs, message):
    assert await call(http, method, server.url + path, **kwargs) == (400, {"error": message})


async def test_wrong_method_unknown_path_and_large_bodies_are_json_errors(http):
    async with BootstrapServer(BootstrapConfig(port=0, max_body_bytes=64)) as server:
        status, body = await call(http, "POST", f"{server.url}/route", json={})
        assert (status, body) == (405, {"error": "405: Method Not Allowed"})
        assert await call(http, "GET", f"{server.url}/nope") == (404, {"error": "404: Not Found"})
        status, body = await call(http, "POST", f"{server.url}/query_dp_ranks",
                                  json={"bootstrap_rooms": list(range(100))})
        assert (status, body) == (413, {"error": "Maximum request body size 64 exceeded."})


async def test_rooms_expire_exactly_at_ttl_and_only_known_rooms_are_answered(server, http):
    url, clock = server.url, server.clock
    big = 2**63 - 1
    for room, rank in ((big, 1), (42, 0)):
        assert await call(http, "POST", f"{url}/register_dp_rank",
                          json={"bootstrap_room": room, "dp_rank": rank}) == (200, {"status": "ok"})
    query = {"bootstrap_rooms": [42, 43, big, "44"]}
    assert await call(http, "POST", f"{url}/query_dp_ranks", json=query) == (200, {"42": 0, str(big): 1})
    clock.now += 119.999
    assert (await call(http, "POST", f"{url}/query_dp_ranks", json=query))[1] == {"42": 0, str(big): 1}
    clock.now += 0.001
    assert await call(http, "POST", f"{url}/query_dp_ranks", json=query) == (200, {})
    assert server.registry.num_rooms == 0


async def test_a_full_room_table_is_429_naming_the_limit_until_an_entry_expires(http):
    clock = FakeClock()
    async with BootstrapServer(BootstrapConfig(host="127.0.0.1", port=0, room_ttl_s=120.0, max_rooms=2),
                               clock=clock) as srv:
        url = f"{srv.url}/register_dp_rank"
        for room in (1, 2):
            assert await call(http, "POST", url, json={"bootstrap_room": room, "dp_rank": 0}) == (200, {"status": "ok"})
            clock.now += 1
        full = {"error": "the registry holds 2 rooms, its limit (max_rooms): a room can be registered once an entry "
                         "expires (120 s after its registration)"}
        assert await call(http, "POST", url, json={"bootstrap_room": 3, "dp_rank": 0}) == (429, full)
        assert await call(http, "POST", url, json={"bootstrap_room": 2, "dp_rank": 1}) == (200, {"status": "ok"})
        async with BootstrapClient("127.0.0.1", srv.port, FAST) as client:
            with pytest.raises(BootstrapRejected) as info:
                await client.register_dp_rank(3, 0)
            assert (str(info.value), info.value.detail) == (
                f"bootstrap server 127.0.0.1:{srv.port} answered 429 to POST /register_dp_rank: the registry holds as "
                "many rooms as its --max-rooms allows", full["error"])
            clock.now = 1000.0 + 120.0  # room 1 (registered at 1000) has expired
            await client.register_dp_rank(3, 0)
            assert await client.query_dp_ranks([1, 2, 3]) == {2: 1, 3: 0}
        assert srv.registry.num_rooms == 2


async def test_client_waits_for_topology_until_the_last_rank_registers(server):
    regs = [RankRegistrationMsg(dp_rank=dp, dp_size=2, rank_ip="127.0.0.1", rank_port=7000 + dp, page_size=16,
                                kv_cache_dtype="bfloat16", transfer_backend="tcp", agent_name=f"p{dp}")
            for dp in (0, 1)]
    async with BootstrapClient("127.0.0.1", server.port, FAST) as client:
        assert await client.health() is True
        await client.register_rank(regs[0])
        waiter = asyncio.create_task(client.get_topology())
        await asyncio.sleep(0.1)
        assert not waiter.done()
        await client.register_rank(regs[1])
        assert await asyncio.wait_for(waiter, 5) == TopologyMsg(
            dp_size=2, page_size=16, kv_cache_dtype="bfloat16", transfer_backend="tcp")
        address = await client.get_rank_address(1)
        assert (address.rank_ip, address.rank_port, address.agent_name, address.transfer_backend) == (
            "127.0.0.1", 7001, "p1", "tcp")
        with pytest.raises(BootstrapRejected) as info:
            await client.get_rank_address(3)
        assert info.value.status == 404
        assert str(info.value) == f"bootstrap server 127.0.0.1:{server.port} answered 404 to GET /route"
        assert info.value.detail == "unknown rank: dp_rank 3 is out of range for dp_size 2"  # for logs only


async def test_client_times_out_on_an_incomplete_topology(server):
    async with BootstrapClient("127.0.0.1", server.port, FAST) as client:
        start = time.monotonic()
        with pytest.raises(BootstrapTimeout) as info:
            await client.get_topology(deadline_s=0.3)
        assert 0.3 <= time.monotonic() - start < 2.0
    text = str(info.value)
    assert text.startswith(f"bootstrap server {server.url}: GET /route got no answer within 0.3 s (elapsed 0.3")
    assert text.endswith(" attempts; last: HTTP 503)")  # the server's text stays out of errors


async def test_client_reports_an_unreachable_server():
    probe = BootstrapServer(BootstrapConfig(port=0))
    port = await probe.start()
    await probe.close()  # the port is now (very likely) closed
    async with BootstrapClient("127.0.0.1", port, FAST) as client:
        assert await client.health() is False
        with pytest.raises(BootstrapUnavailable) as info:
            await client.register_dp_rank(1, 0, deadline_s=0.2)
    assert str(info.value).startswith(
        f"bootstrap server http://127.0.0.1:{port}: POST /register_dp_rank got no answer within 0.2 s (elapsed 0.2")
    assert "ClientConnectorError" in str(info.value)


async def test_concurrent_room_queries_share_one_post():
    posts = []

    async def count(request, response):
        if request.path == "/query_dp_ranks":
            posts.append(await request.json())

    server = BootstrapServer(BootstrapConfig(port=0))
    server.app.on_response_prepare.append(count)
    async with server, BootstrapClient("127.0.0.1", server.port, FAST) as client:
        for room in (1, 2, 3):
            await client.register_dp_rank(room, 0)
        answers = await asyncio.gather(client.query_dp_ranks([1, 9]), client.query_dp_ranks([2]),
                                       client.query_dp_ranks([3, 1]))
    assert answers == [{1: 0}, {2: 0}, {3: 0, 1: 0}]
    assert posts == [{"bootstrap_rooms": [1, 2, 3, 9]}]


async def test_wait_for_dp_rank_polls_until_registered_or_deadline(server):
    async with BootstrapClient("127.0.0.1", server.port, FAST) as client:
        waiter = asyncio.create_task(client.wait_for_dp_rank(77, deadline_s=5.0))
        await asyncio.sleep(0.1)
        await client.register_dp_rank(77, 1)
        assert await asyncio.wait_for(waiter, 5) == 1
        with pytest.raises(BootstrapTimeout, match=r"room 78 not registered within 0.2 s"):
            await client.wait_for_dp_rank(78, deadline_s=0.2)


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_standalone_bootstrap_process_serves_and_exits_cleanly_on_a_stop_signal(stop):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("import sys; from bootstrap.server import run_bootstrap; from disagg.registry_config import BootstrapConfig; "
            f"sys.exit(run_bootstrap(BootstrapConfig(host='127.0.0.1', port={port})))")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        async with BootstrapClient("127.0.0.1", port, FAST) as client:
            await client.register_dp_rank(5, 1, deadline_s=15.0)  # retried until the process listens
            assert await client.query_dp_ranks([5, 6]) == {5: 1}
            assert await client.query_dp_ranks([]) == {}
        proc.send_signal(stop)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_repeated_registration_logs_at_debug_and_a_new_or_moved_one_at_info(server, http):
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        for port in (7100, 7100, 7100, 7101):  # new, two refreshes, moved
            await call(http, "PUT", f"{server.url}/route", json=sglang_put_body(0, port, agent_name="p0"))
    got = [(e["log_level"], e["outcome"]) for e in logs if e["event"] == "prefill rank registered"]
    assert got == [("info", "new"), ("debug", "repeated"), ("debug", "repeated"), ("info", "replaced")]
