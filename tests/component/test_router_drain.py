"""Drain and the router, over real HTTP with fake servers: a draining server is skipped (its 503 on a
new request, or its red health check), and the router's own drain (in process and as `disagg router`
under SIGTERM) finishes what is in flight, refuses the rest and aborts what outlives the timeout."""

import asyncio
import signal
import time

import aiohttp
import msgspec
import pytest
from aiohttp import web
from cli_process import ready_url, start_cli
from fake_engine import wait_for
from test_router import SSE_CHUNKS, FakeServer, cluster, get, json_answer, post, sleep_then, sse_answer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]
SERVER_DRAINING = {"error": {"message": "server is draining: it accepts no new requests",
                             "type": "ServiceUnavailableError", "param": None, "code": "draining"}}
ROUTER_DRAINING = {"error": {"message": "router is draining: it accepts no new requests",
                             "type": "ServiceUnavailableError", "param": None, "code": "draining"}}


def router_shut_down(reason: str) -> dict:
    return {"error": {"message": f"router shut down before the request finished ({reason})",
                      "type": "ServiceUnavailableError", "param": None, "code": "shutdown"}}


class DrainingServer(FakeServer):
    """A fake server that, once `draining`, answers /health and new requests as our servers do."""

    def __init__(self, answer=None, *, draining: bool = False):
        super().__init__(answer)
        self.draining = draining

    async def _health(self, request):
        if self.draining:
            return web.json_response(SERVER_DRAINING, status=503)
        return await super()._health(request)

    async def _generate(self, request):
        if self.draining:
            self.bodies.append(msgspec.json.decode(await request.read()))
            return web.json_response(SERVER_DRAINING, status=503)
        return await super()._generate(request)


async def server_list(router, role: str) -> list[tuple[str, str | None]]:
    _, _, raw = await get(router, "/server_info")
    return [(s["health"], s["last_error"]) for s in msgspec.json.decode(raw)[role]]


# --- servers that drain ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_server_refusing_as_draining_is_marked_unhealthy_and_the_request_goes_elsewhere(role, stream):
    answer = sse_answer(SSE_CHUNKS) if stream else json_answer({"server": "well"})
    draining, well, other = DrainingServer(answer), FakeServer(answer), FakeServer(answer)
    prefills, decodes = ([draining, well], [other]) if role == "prefill" else ([other], [draining, well])
    async with cluster(prefills, decodes) as router:  # round robin: the draining server is picked first
        draining.draining = True  # after the router's first health check, before its next one
        first = await post(router, "/generate", {"text": "1", "stream": stream})
        second = await post(router, "/generate", {"text": "2", "stream": stream})
        listed = await server_list(router, role)
    expected = b"".join(SSE_CHUNKS) if stream else b'{"server": "well"}'
    assert [(status, raw) for status, _, raw in (first, second)] == [(200, expected), (200, expected)]
    assert [(h["X-Disagg-Path"], h.get("X-Disagg-Path-Reason")) for _, h, _ in (first, second)] == [
        ("retried", "draining"), ("pd", None)]  # not counted as a retry, but the answer came from a second pair
    assert (len(draining.bodies), len(well.bodies)) == (1, 2)
    assert listed == [("unhealthy", "refused a request with 503 (draining)"), ("healthy", None)]
    retried_room, first_room = well.bodies[0]["bootstrap_room"], draining.bodies[0]["bootstrap_room"]
    assert retried_room != first_room  # a new pair gets a new room


async def test_when_every_decode_drains_the_client_gets_503():
    async with cluster([FakeServer()], [DrainingServer(draining=True)]) as router:
        status, _, raw = await post(router, "/generate", {"text": "hi"})
    assert (status, msgspec.json.decode(raw)["error"]["message"]) == (503, "no healthy decode server")


async def test_health_checks_mark_a_draining_server_unhealthy_and_requests_go_to_the_other():
    sick, well = DrainingServer(json_answer({"server": "sick"})), FakeServer(json_answer({"server": "well"}))
    async with cluster([FakeServer()], [sick, well], health_check_interval_s=0.05) as router:
        assert (await post(router, "/generate", {"text": "0"}))[2] == b'{"server": "sick"}'
        sick.draining = True
        deadline = time.monotonic() + 5
        while (await server_list(router, "decode"))[0][0] != "unhealthy" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        answers = [(await post(router, "/generate", {"text": str(i)}))[2] for i in range(3)]
        listed = await server_list(router, "decode")
    assert listed == [("unhealthy", "/health answered 503 (draining)"), ("healthy", None)]
    assert answers == [b'{"server": "well"}'] * 3
    assert len(sick.bodies) == 1  # only the request from before the drain


# --- the router's own drain --------------------------------------------------------------------------


async def test_a_draining_router_is_red_refuses_new_requests_and_finishes_its_streams():
    decode = FakeServer(sse_answer(SSE_CHUNKS, delay_s=0.1))
    async with cluster([FakeServer()], [decode]) as router:
        async with router.http.post(router.url + "/generate", json={"text": "hi", "stream": True}) as resp:
            first = await resp.content.readuntil(b"\n\n")
            draining = asyncio.create_task(router.drain.run(10.0))
            await asyncio.sleep(0)
            health = await get(router, "/health")
            refused = await post(router, "/v1/completions", {"prompt": "new"})
            rest = await resp.read()
        assert await draining == 0
    assert (health[0], msgspec.json.decode(health[2])) == (503, ROUTER_DRAINING)
    assert (refused[0], msgspec.json.decode(refused[2])) == (503, ROUTER_DRAINING)
    assert first + rest == b"".join(SSE_CHUNKS)
    assert len(decode.bodies) == 1


async def test_the_router_timeout_aborts_streams_and_unary_requests_and_cancels_their_legs():
    streaming = FakeServer(sse_answer(SSE_CHUNKS[:1], then_sleep_s=30.0))
    waiting = FakeServer(sleep_then(30.0))
    async with cluster([FakeServer(), FakeServer()], [streaming, waiting]) as router:
        async with router.http.post(router.url + "/generate", json={"text": "s", "stream": True}) as resp:
            first = await resp.content.readuntil(b"\n\n")
            unary = asyncio.create_task(post(router, "/generate", {"text": "u"}))
            await wait_for(lambda: router.drain.num_in_flight == 2)
            assert await router.drain.run(0.2) == 2
            rest = await resp.read()
        status, _, raw = await unary
        await asyncio.wait_for(asyncio.gather(streaming.cancelled.wait(), waiting.cancelled.wait()), 2.0)
    error_event = msgspec.json.encode(router_shut_down("shutdown timeout 0.2 s"))
    assert first + rest == SSE_CHUNKS[0] + b"data: " + error_event + b"\n\ndata: [DONE]\n\n"
    assert (status, msgspec.json.decode(raw)) == (503, router_shut_down("shutdown timeout 0.2 s"))


# --- `disagg router` under SIGTERM ---------------------------------------------------------------------


async def start_router(*servers: FakeServer, timeout_s: float) -> tuple[asyncio.subprocess.Process, str]:
    prefill, decode = servers
    proc, lines = await start_cli("router", "--host", "127.0.0.1", "--port", "0", "--prefill", prefill.url, "none",
                                  "--decode", decode.url, "--health-check-interval-s", "0",
                                  "--shutdown-timeout", str(timeout_s), timeout_s=20)
    assert lines == [lines[-1]] and lines[-1].startswith("ready: http://127.0.0.1:"), lines
    return proc, ready_url(lines)


@pytest.mark.parametrize("second_signal", [False, True])
async def test_disagg_router_drains_on_sigterm_and_exits_0(second_signal):
    answer = sse_answer(SSE_CHUNKS[:1], then_sleep_s=30.0) if second_signal else sse_answer(SSE_CHUNKS, delay_s=0.2)
    prefill, decode = FakeServer(), FakeServer(answer)
    await prefill.start()
    await decode.start()
    proc, url = await start_router(prefill, decode, timeout_s=60)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/generate", json={"text": "hi", "stream": True}) as resp:
                first = await resp.content.readuntil(b"\n\n")
                proc.send_signal(signal.SIGTERM)
                async with http.get(url + "/health") as health:
                    assert (health.status, await health.json()) == (503, ROUTER_DRAINING)
                if second_signal:
                    proc.send_signal(signal.SIGTERM)
                rest = await resp.read()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await prefill.close()
        await decode.close()
    if second_signal:
        event = msgspec.json.encode(router_shut_down("a second stop signal ended the drain"))
        assert first + rest == SSE_CHUNKS[0] + b"data: " + event + b"\n\ndata: [DONE]\n\n"
    else:
        assert first + rest == b"".join(SSE_CHUNKS)
