"""The router over real HTTP on 127.0.0.1 (port 0), in front of fake prefill and decode servers that
record what they receive. Every leg, status code and byte the client sees is asserted exactly."""

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import msgspec
import pytest
from aiohttp import web

from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from disagg.router.workers import Role
from fake_engine import wait_for

pytestmark = pytest.mark.timeout(30)
GENERATE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
SSE_CHUNKS = [b'data: {"text": "a", "index": 0}\n\n', b'data: {"text": "ab", "index": 0}\n\n',
              b'data: {"text": "abc", "index": 0}\n\n', b"data: [DONE]\n\n"]
BAD_REQUEST = {"error": {"message": "max_tokens must be at least 1, got 0", "type": "BadRequestError",
                         "param": "max_tokens", "code": None}}


def json_answer(payload, status: int = 200, headers: dict | None = None):
    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        return web.json_response(payload, status=status, headers=headers)
    return answer


def sse_answer(chunks: list[bytes], delay_s: float = 0.0, then_sleep_s: float = 0.0, headers: dict | None = None):
    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", **(headers or {})})
        await out.prepare(request)
        for chunk in chunks:
            await out.write(chunk)
            await asyncio.sleep(delay_s)
        await asyncio.sleep(then_sleep_s)
        await out.write_eof()
        return out
    return answer


def sleep_then(seconds: float, then=None):
    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return await (then or json_answer({"late": True}))(request, body)
    return answer


def echo_dp_rank(offset: int = 0, dp_size: int = 1, where: str = "meta_info"):
    """A decode that reports the rank it was sent (plus `offset`, to fake a mis-routing)."""
    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        rank = (body["routed_dp_rank"] + offset) % dp_size
        if where == "meta_info":
            return web.json_response({"text": "ok", "meta_info": {"dp_rank": rank}})
        if where == "top":
            return web.json_response({"choices": [], "dp_rank": rank})
        return web.json_response({"choices": []}, headers={"X-data-parallel-rank": str(rank)})
    return answer


class FakeServer:
    """A prefill or decode server stand-in: records bodies, headers and cancellations."""

    def __init__(self, answer=None, *, health_status: int = 200, dp_size: int = 1, server_info: dict | None = None):
        self.answer = answer or json_answer({"text": "", "meta_info": {}})
        self.health_status = health_status
        self.dp_size = dp_size
        self.server_info = server_info or {}  # more of /server_info (a decode's max_local_prefill_tokens)
        self.raw: list[bytes] = []
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.headers: list[dict] = []
        self.server_info_hits = 0
        self.cancelled = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "FakeServer":
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model_id}", self._model)
        app.router.add_get("/health_generate", self._health)
        for path in GENERATE_PATHS:
            app.router.add_post(path, self._generate)
        self.add_routes(app)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    def add_routes(self, app: web.Application) -> None:
        """More routes a subclass answers (none here)."""

    async def close(self) -> None:
        await self.runner.cleanup()

    async def _health(self, request):
        return web.Response(status=self.health_status, text="OK")

    async def _server_info(self, request):
        self.server_info_hits += 1
        return web.json_response({"dp_size": self.dp_size, "disaggregation_mode": "fake", **self.server_info})

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}],
                                  "seen_auth": request.headers.get("Authorization")})

    async def _model(self, request):
        return web.json_response({"id": request.match_info["model_id"], "object": "model"})

    async def _generate(self, request):
        raw = await request.read()
        self.raw.append(raw)
        self.bodies.append(msgspec.json.decode(raw))
        self.paths.append(request.path)
        self.headers.append(dict(request.headers))
        try:
            return await self.answer(request, self.bodies[-1])
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@contextlib.asynccontextmanager
async def cluster(prefills, decodes, rng=None, randbits=None, bootstrap_ports=None, **overrides):
    """Start the fakes and a router in front of them (a decode given as a URL string is not started)."""
    fakes = [s for s in (*prefills, *decodes) if isinstance(s, FakeServer)]
    for fake in fakes:
        await fake.start()
    ports = bootstrap_ports or [8998] * len(prefills)
    settings = {"host": "127.0.0.1", "port": 0, "health_check_interval_s": 60.0, "health_check_timeout_s": 1.0,
                "request_timeout_s": 10.0, **overrides}
    config = RouterConfig(prefill=tuple(PrefillEndpoint(p.url, port) for p, port in zip(prefills, ports)),
                          decode=tuple(getattr(d, "url", d) for d in decodes), **settings)
    kwargs = {"rng": rng or random.Random(0)}
    if randbits is not None:
        kwargs["randbits"] = randbits
    try:
        async with RouterServer(config, **kwargs) as router, aiohttp.ClientSession() as http:
            router.http = http
            yield router
    finally:
        for fake in fakes:
            await fake.close()


async def post(router, path: str, body: dict, headers: dict | None = None):
    async with router.http.post(router.url + path, json=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def get(router, path: str, headers: dict | None = None):
    async with router.http.get(router.url + path, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def error_of(raw: bytes) -> dict:
    return msgspec.json.decode(raw)["error"]


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


# --- dispatch ---------------------------------------------------------------------------------------


async def test_both_legs_get_the_same_body_and_the_client_gets_the_decode_answer():
    decode_answer = b'{"text": "hello", "meta_info": {"dp_rank": 0, "completion_tokens": 2}}'

    async def decode_raw(request, body):
        return web.Response(body=decode_answer, content_type="application/json",
                            headers={"X-data-parallel-rank": "0", "X-Other": "dropped"})

    prefill, decode = FakeServer(), FakeServer(decode_raw)
    async with cluster([prefill], [decode], bootstrap_ports=[9100]) as router:
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
        status, headers, raw = await post(router, "/generate", body, {"Authorization": "Bearer k"})
    assert (status, raw) == (200, decode_answer)
    assert headers["X-data-parallel-rank"] == "0" and "X-Other" not in headers
    assert (headers["X-Disagg-Path"], "X-Disagg-Path-Reason" in headers, "X-Disagg-Retries" in headers) == (
        "pd", False, False)
    assert prefill.raw == decode.raw  # the same bytes on both legs
    sent = decode.bodies[0]
    room = sent["bootstrap_room"]
    assert isinstance(room, int) and 0 <= room < 2**63
    assert sent == {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": 9100, "bootstrap_room": room}
    assert prefill.headers[0]["Authorization"] == decode.headers[0]["Authorization"] == "Bearer k"


async def test_every_generate_endpoint_is_dispatched_on_its_own_path_with_the_injected_room():
    prefill = FakeServer(json_answer({"p": 1}))
    decode = FakeServer(json_answer({"id": "cmpl-1", "choices": [{"text": "x"}], "dp_rank": 0}))
    async with cluster([prefill], [decode], randbits=lambda bits: 4242) as router:
        for path in GENERATE_PATHS:
            status, _, raw = await post(router, path, {"prompt": "hi", "max_tokens": 1})
            assert (status, msgspec.json.decode(raw)) == (200, {"id": "cmpl-1", "choices": [{"text": "x"}], "dp_rank": 0})
    assert prefill.paths == decode.paths == list(GENERATE_PATHS)
    assert [b["bootstrap_room"] for b in decode.bodies] == [4242] * 4


async def test_prompt_logprobs_come_from_the_prefill():
    prefill = FakeServer(json_answer({"text": "", "meta_info": {"input_token_logprobs": [[None, 1, None], [-0.25, 2, None]]}}))
    decode = FakeServer(json_answer({"text": "ok", "meta_info": {"output_token_logprobs": [[-0.5, 7, None]]}}))
    async with cluster([prefill], [decode]) as router:
        status, _, raw = await post(router, "/generate", {"input_ids": [1, 2], "return_logprob": True})
    assert status == 200
    assert msgspec.json.decode(raw) == {"text": "ok", "meta_info": {
        "output_token_logprobs": [[-0.5, 7, None]], "input_token_logprobs": [[None, 1, None], [-0.25, 2, None]]}}


async def test_streaming_passes_chunks_through_in_order():
    prefill = FakeServer(sse_answer([b'data: {"text": ""}\n\n', b"data: [DONE]\n\n"]))
    decode = FakeServer(sse_answer(SSE_CHUNKS, delay_s=0.02, headers={"X-data-parallel-rank": "0"}))
    async with cluster([prefill], [decode]) as router:
        async with router.http.post(router.url + "/v1/completions", json={"prompt": "hi", "stream": True}) as resp:
            lines = [line async for line in resp.content]
            status, headers = resp.status, resp.headers
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert headers["X-data-parallel-rank"] == "0"
    assert b"".join(lines) == b"".join(SSE_CHUNKS)
    assert [line for line in lines if line.startswith(b"data:")] == [c[:-1] for c in SSE_CHUNKS]
    assert prefill.raw == decode.raw and decode.bodies[0]["stream"] is True


# --- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_failing_prefill_returns_its_error_and_cancels_the_decode(stream):
    prefill = FakeServer(json_answer(BAD_REQUEST, status=400))
    decode = FakeServer(sse_answer([], then_sleep_s=30.0) if stream else sleep_then(30.0))
    async with cluster([prefill], [decode]) as router:
        start = time.monotonic()
        status, _, raw = await post(router, "/generate", {"text": "hi", "stream": stream})
        elapsed = time.monotonic() - start
        await asyncio.wait_for(decode.cancelled.wait(), 2.0)
        in_flight = [info.in_flight for role in Role for info in router.router.pool.infos(role)]
    assert in_flight == [0, 0]
    assert (status, msgspec.json.decode(raw)) == (400, BAD_REQUEST)
    assert elapsed < 2.0


async def test_failing_decode_returns_its_error_and_cancels_the_prefill():
    not_found = {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                           "param": "model", "code": "model_not_found"}}
    prefill = FakeServer(sleep_then(30.0))
    decode = FakeServer(json_answer(not_found, status=404))
    async with cluster([prefill], [decode]) as router:
        status, _, raw = await post(router, "/v1/chat/completions", {"model": "x", "messages": []})
        await asyncio.wait_for(prefill.cancelled.wait(), 2.0)
    assert (status, msgspec.json.decode(raw)) == (404, not_found)


async def test_prefill_failing_mid_stream_ends_the_stream_with_an_error_event():
    prefill = FakeServer(sleep_then(0.3, json_answer({"error": {"message": "KV transfer failed"}}, status=500)))
    decode = FakeServer(sse_answer(SSE_CHUNKS[:1], then_sleep_s=30.0))
    async with cluster([prefill], [decode]) as router:
        status, _, raw = await post(router, "/generate", {"text": "hi", "stream": True})
        await asyncio.wait_for(decode.cancelled.wait(), 2.0)
    assert status == 200
    assert raw == SSE_CHUNKS[0] + b'data: {"error":{"message":"KV transfer failed"}}\n\ndata: [DONE]\n\n'


async def test_dead_decode_is_a_502_naming_it():
    url = dead_url()
    prefill = FakeServer()
    async with cluster([prefill], [url], health_check_interval_s=0.0, connect_timeout_s=2.0) as router:
        status, _, raw = await post(router, "/generate", {"text": "hi"})
    err = error_of(raw)
    assert status == 502 and err["type"] == "BadGatewayError" and err["code"] == "upstream_unreachable"
    assert err["message"].startswith(f"decode server {url} unreachable: ")


DEAD_RANK = {"error": {"message": "DP worker 0 died (exited with code -9)", "type": "ServiceUnavailableError",
                       "param": None, "code": None}}


def fail_first(times: int, failure, then):
    """Answer `failure` to the first `times` requests, then `then`."""
    seen = []

    async def answer(request, body):
        seen.append(body["bootstrap_room"])
        return await (failure if len(seen) <= times else then)(request, body)
    return answer


@pytest.mark.parametrize("stream", [False, True])
async def test_a_503_before_any_byte_is_sent_again_with_a_fresh_room(stream):
    rooms = iter([11, 12, 13])
    ok = sse_answer(SSE_CHUNKS) if stream else json_answer({"text": "ok"})
    prefill, decode = FakeServer(sleep_then(0.2)), FakeServer(fail_first(1, json_answer(DEAD_RANK, status=503), ok))
    async with cluster([prefill], [decode], randbits=lambda bits: next(rooms)) as router:
        status, headers, raw = await post(router, "/generate", {"text": "hi", "stream": stream})
    assert (status, headers["X-Disagg-Retries"], headers["X-Disagg-Path"], headers["X-Disagg-Path-Reason"]) == (
        200, "1", "retried", "decode_503")
    assert raw == (b"".join(SSE_CHUNKS) if stream else b'{"text": "ok"}')
    assert [b["bootstrap_room"] for b in decode.bodies] == [b["bootstrap_room"] for b in prefill.bodies] == [11, 12]


@pytest.mark.parametrize("max_retries, attempts", [(2, 3), (0, 1)])
async def test_retries_are_bounded_and_the_last_answer_is_passed_on(max_retries, attempts):
    prefill, decode = FakeServer(sleep_then(0.2)), FakeServer(json_answer(DEAD_RANK, status=503))
    async with cluster([prefill], [decode], retry_max_retries=max_retries) as router:
        status, headers, raw = await post(router, "/generate", {"text": "hi"})
        _, _, metrics = await get(router, "/metrics")
    assert (status, msgspec.json.decode(raw), len(decode.bodies)) == (503, DEAD_RANK, attempts)
    assert "X-Disagg-Retries" not in headers
    counted = [line for line in metrics.decode().splitlines() if line.startswith("sgl_router_retries") and "_total{" in line]
    if max_retries:
        assert counted == ['sgl_router_retries_total{route="/generate"} 2.0',
                           'sgl_router_retries_exhausted_total{route="/generate"} 1.0']
    else:
        assert counted == []


async def test_a_failure_that_is_not_retryable_is_answered_at_once():
    prefill, decode = FakeServer(sleep_then(0.2)), FakeServer(json_answer(BAD_REQUEST, status=400))
    async with cluster([prefill], [decode]) as router:
        status, _, raw = await post(router, "/generate", {"text": "hi"})
    assert (status, msgspec.json.decode(raw), len(decode.bodies)) == (400, BAD_REQUEST, 1)


async def test_client_leaving_cancels_both_legs():
    prefill, decode = FakeServer(sleep_then(30.0)), FakeServer(sleep_then(30.0))
    async with cluster([prefill], [decode]) as router:
        with pytest.raises(asyncio.TimeoutError):
            async with router.http.post(router.url + "/generate", json={"text": "hi"},
                                        timeout=aiohttp.ClientTimeout(total=0.3)) as resp:
                await resp.read()
        await asyncio.wait_for(asyncio.gather(prefill.cancelled.wait(), decode.cancelled.wait()), 2.0)
        await asyncio.sleep(0.05)
        in_flight = [info.in_flight for role in Role for info in router.router.pool.infos(role)]
    assert in_flight == [0, 0]


async def test_least_load_sends_the_next_request_to_the_idle_decode():
    release = asyncio.Event()

    async def held(request, body):
        await asyncio.wait_for(release.wait(), 5.0)
        return web.json_response({"server": "A"})

    busy, idle = FakeServer(held), FakeServer(json_answer({"server": "B"}))
    async with cluster([FakeServer()], [busy, idle], policy="least_load") as router:
        first = asyncio.create_task(post(router, "/generate", {"text": "1"}))
        while not busy.bodies:
            await asyncio.sleep(0.01)
        second = await post(router, "/generate", {"text": "2"})
        third = await post(router, "/generate", {"text": "3"})
        release.set()
        answers = [msgspec.json.decode(r[2])["server"] for r in (await first, second, third)]
    assert answers == ["A", "B", "B"]


def metric_values(text: bytes, prefix: str) -> dict[str, float]:
    """`name value` lines of the Prometheus text whose name starts with `prefix` (not the `_created` stamps)."""
    lines = [line.split() for line in text.decode().splitlines()
             if line.startswith(prefix) and not line.split()[0].endswith("_created")]
    return {name: float(value) for name, value in lines}


async def test_cache_aware_sends_a_shared_prefix_to_the_same_prefill_rank():
    prefills = [FakeServer(dp_size=2), FakeServer(dp_size=2)]
    decode = FakeServer(dp_size=4)
    prefix = "You are a helpful assistant. " * 4
    prompts = [prefix + "Question one?", prefix + "Question two?", "unrelated", "also unrelated"]
    async with cluster(prefills, [decode], policy="cache_aware") as router:
        statuses = [(await post(router, "/v1/completions", {"prompt": p, "max_tokens": 1}))[0] for p in prompts]
        _, _, metrics = await get(router, "/metrics")
    assert statuses == [200] * 4
    # The first misses (every tree is empty: the first prefill's rank 0), the second hits it; each
    # unrelated prompt misses and takes the smallest tree: the first prefill's rank 1, then the second's rank 0.
    got = [(p["prompt"], p["routed_dp_rank"], p["disagg_prefill_dp_rank"]) for p in prefills[0].bodies]
    assert got == [(prompts[0], 0, 0), (prompts[1], 0, 0), (prompts[2], 1, 1)]
    assert [(p["prompt"], p["routed_dp_rank"], p["disagg_prefill_dp_rank"]) for p in prefills[1].bodies] == [
        (prompts[3], 0, 0)]
    rooms = {p["bootstrap_room"]: p["disagg_prefill_dp_rank"] for f in prefills for p in f.bodies}
    assert {d["bootstrap_room"]: d["disagg_prefill_dp_rank"] for d in decode.bodies} == rooms
    assert all("routed_dp_rank" not in d for d in decode.bodies)  # the decode picks its own rank
    # Read once each by the first health check: the prefills' dp_size, the decode's local-prefill limit.
    assert [f.server_info_hits for f in (*prefills, decode)] == [1, 1, 1]
    assert metric_values(metrics, "sgl_router_cache_") == {"sgl_router_cache_hits_total": 1.0,
                                                            "sgl_router_cache_misses_total": 3.0}
    ratio = metric_values(metrics, "disagg_router_cache_match_ratio_")
    assert (ratio["disagg_router_cache_match_ratio_count"], ratio["disagg_router_cache_match_ratio_sum"]) == (
        4.0, len(prefix + "Question ") / len(prompts[1]))


# --- the fields the router owns ---------------------------------------------------------------------

INTERNAL = {"kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "127.0.0.1",
                                   "remote_port": 1, "remote_request_id": "x", "remote_block_ids": [0]},
            "bootstrap_host": "10.6.6.6", "bootstrap_port": 1, "bootstrap_room": 7,
            "routed_dp_rank": 1, "disagg_prefill_dp_rank": 0, "data_parallel_rank": 1}
ROUTING = {"routed_dp_rank": 1, "disagg_prefill_dp_rank": 0, "data_parallel_rank": 1}


@pytest.mark.parametrize("trusted", [False, True])
async def test_a_client_internal_fields_never_reach_a_leg_and_its_routing_only_when_trusted(trusted):
    prefill, decode = FakeServer(), FakeServer()
    async with cluster([prefill], [decode], bootstrap_ports=[9100], randbits=lambda bits: 4242,
                       trust_client_routing=trusted) as router:
        status, _, _ = await post(router, "/generate", {"text": "hi", **INTERNAL}, {"X-data-parallel-rank": "1"})
    assert status == 200
    assert prefill.bodies == decode.bodies == [{"text": "hi", **(ROUTING if trusted else {}), "bootstrap_host": "127.0.0.1",
                                                "bootstrap_port": 9100, "bootstrap_room": 4242}]
    assert [h.get("X-data-parallel-rank") for h in prefill.headers + decode.headers] == (
        ["1", "1"] if trusted else [None, None])


@pytest.mark.parametrize("trusted", [False, True])
async def test_the_pull_protocol_sends_its_own_kv_transfer_params_only(trusted):
    ticket = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": "127.0.0.1",
              "remote_port": 17001, "remote_request_id": "p-1", "remote_block_ids": [3]}
    prefill = FakeServer(json_answer({"choices": [], "kv_transfer_params": ticket}))
    decode = FakeServer(json_answer({"choices": [{"text": "x"}]}))
    async with cluster([prefill], [decode], protocol="pull", trust_client_routing=trusted) as router:
        status, _, raw = await post(router, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **INTERNAL},
                                    {"X-data-parallel-rank": "1"})
    assert (status, msgspec.json.decode(raw)) == (200, {"choices": [{"text": "x"}]})
    routing = ROUTING if trusted else {}
    assert prefill.bodies == [{"prompt": "hi", "max_tokens": 2, **routing, "stream": False,
                               "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}]
    assert decode.bodies == [{"prompt": "hi", "max_tokens": 2, **routing, "kv_transfer_params": ticket}]
    assert [h.get("X-data-parallel-rank") for h in prefill.headers + decode.headers] == (
        ["1", "1"] if trusted else [None, None])


# --- health -----------------------------------------------------------------------------------------


async def test_unhealthy_servers_are_skipped_and_reported():
    prefill = FakeServer()
    sick, well = FakeServer(health_status=503), FakeServer(json_answer({"ok": 1}))
    async with cluster([prefill], [sick, well]) as router:
        for _ in range(3):
            assert (await post(router, "/generate", {"text": "hi"}))[0] == 200
        status, _, raw = await get(router, "/health")
        assert (status, msgspec.json.decode(raw)) == (200, {"status": "ok", "healthy_prefill": 1, "healthy_decode": 1})
        _, _, info = await get(router, "/server_info")
        decode_info = msgspec.json.decode(info)["decode"]
    assert (len(sick.bodies), len(well.bodies)) == (0, 3)
    assert [(d["url"], d["health"], d["last_error"]) for d in decode_info] == [
        (sick.url, "unhealthy", "/health answered 503"), (well.url, "healthy", None)]


async def test_health_generate_asks_every_healthy_server():
    prefill, decode, sick = FakeServer(), FakeServer(), FakeServer(health_status=503)
    async with cluster([prefill], [decode, sick]) as router:
        status, _, raw = await get(router, "/health_generate")
    assert (status, msgspec.json.decode(raw)) == (200, {"status": "ok", "checked": [prefill.url, decode.url]})


async def test_no_healthy_decode_is_a_503():
    async with cluster([FakeServer()], [FakeServer(health_status=503)]) as router:
        status, _, raw = await post(router, "/generate", {"text": "hi"})
        health_status, _, health_raw = await get(router, "/health")
    assert (status, error_of(raw)["message"]) == (503, "no healthy decode server")
    assert (health_status, error_of(health_raw)["message"]) == (503, "no healthy decode server")


# --- external DP routing test mode ------------------------------------------------------------------


async def test_external_dp_routing_pins_ranks_on_both_legs():
    prefill = FakeServer(dp_size=2)
    decode = FakeServer(echo_dp_rank(dp_size=4), dp_size=4)
    async with cluster([prefill], [decode], test_external_dp_routing=True) as router:
        for _ in range(8):
            status, _, _ = await post(router, "/generate", {"text": "hi"}, {"X-data-parallel-rank": "1"})
            assert status == 200
    pairs = list(zip(prefill.bodies, decode.bodies))
    assert all(p["bootstrap_room"] == d["bootstrap_room"] for p, d in pairs)
    assert all(d["disagg_prefill_dp_rank"] == p["routed_dp_rank"] for p, d in pairs)
    assert all(p["disagg_prefill_dp_rank"] == p["routed_dp_rank"] for p, _ in pairs)  # the prefill knows the decode was told
    assert {p["routed_dp_rank"] for p, _ in pairs} <= {0, 1} and {d["routed_dp_rank"] for _, d in pairs} <= {0, 1, 2, 3}
    assert len({d["routed_dp_rank"] for _, d in pairs}) > 1  # random, not constant
    assert all("X-data-parallel-rank" not in h for h in prefill.headers + decode.headers)


@pytest.mark.parametrize("where, path", [("meta_info", "/generate"), ("top", "/v1/completions"),
                                         ("header", "/v1/chat/completions")])
async def test_external_dp_routing_reports_a_mismatch(where, path):
    decode = FakeServer(echo_dp_rank(offset=1, dp_size=3, where=where), dp_size=3)
    async with cluster([FakeServer(dp_size=2)], [decode], test_external_dp_routing=True,
                       health_check_interval_s=0.0) as router:
        status, _, raw = await post(router, path, {"prompt": "hi"})
    sent = decode.bodies[0]["routed_dp_rank"]
    assert status == 500
    assert error_of(raw)["message"] == f"DP rank mismatch: sent routed_dp_rank={sent} to decode, it reported {(sent + 1) % 3}"
    assert decode.server_info_hits == 1  # read lazily: health checks are off


# --- the rest of the HTTP surface -------------------------------------------------------------------


async def test_models_info_and_errors():
    prefill, decode = FakeServer(), FakeServer()
    async with cluster([prefill], [decode], max_body_bytes=1024) as router:
        status, _, raw = await get(router, "/v1/models", {"Authorization": "Bearer k"})
        assert (status, msgspec.json.decode(raw)) == (200, {
            "object": "list", "data": [{"id": "fake-model", "object": "model"}], "seen_auth": "Bearer k"})
        status, _, one = await get(router, "/v1/models/fake-model")
        assert (status, msgspec.json.decode(one)) == (200, {"id": "fake-model", "object": "model"})  # the decode's
        status, _, raw = await post(router, "/generate", {"text": "x" * 2000})
        assert (status, error_of(raw)["type"]) == (413, "RequestTooLargeError")
        status, _, raw = await get(router, "/nope")
        assert (status, error_of(raw)["message"]) == (404, "Not Found: GET /nope")
        async with router.http.post(router.url + "/generate", data=b"[1, 2]") as resp:
            assert (resp.status, error_of(await resp.read())["message"]) == (400, "request body must be a JSON object, got list")
        status, _, raw = await get(router, "/workers")
        listing = msgspec.json.decode(raw)
    assert listing["router"]["policy"] == "round_robin"
    assert [p["bootstrap_port"] for p in listing["prefill"]] == [8998]
    assert prefill.bodies == [] and decode.bodies == []


def test_cli_prints_the_ready_line_and_stops_on_sigint():
    code = ("import argparse, sys; from disagg.router.launch import add_arguments, main; "
            "p = argparse.ArgumentParser(); add_arguments(p); sys.exit(main(p.parse_args(sys.argv[1:])))")
    args = ["--host", "127.0.0.1", "--port", "0", "--prefill", "http://127.0.0.1:1", "none",
            "--decode", "http://127.0.0.1:2", "--health-check-interval-s", "0"]
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("ready: http://127.0.0.1:") and int(line.rsplit(":", 1)[1]) > 0
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=10)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


OVERLOADED = {"error": {"message": "the server has 8 requests waiting, its limit (--max-waiting-requests 8): retry later",
                        "type": "RateLimitError", "param": None, "code": "too_many_waiting_requests"}}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_429_from_one_decode_goes_to_the_other(stream):
    ok = sse_answer(SSE_CHUNKS) if stream else json_answer({"text": "ok"})
    refusing = FakeServer(json_answer(OVERLOADED, status=429, headers={"Retry-After": "1"}))
    prefill, serving = FakeServer(sleep_then(0.2)), FakeServer(ok)
    async with cluster([prefill], [refusing, serving], policy="round_robin") as router:
        status, headers, raw = await post(router, "/generate", {"text": "hi", "stream": stream})
    assert (status, headers["X-Disagg-Retries"], "Retry-After" in headers) == (200, "1", False)
    assert (headers["X-Disagg-Path"], headers["X-Disagg-Path-Reason"]) == ("retried", "decode_429")
    assert raw == (b"".join(SSE_CHUNKS) if stream else b'{"text": "ok"}')
    assert (len(refusing.bodies), len(serving.bodies), len(prefill.bodies)) == (1, 1, 2)


async def test_with_one_pair_the_client_gets_the_429_and_its_retry_after_at_once():
    prefill, decode = FakeServer(sleep_then(0.2)), FakeServer(json_answer(OVERLOADED, status=429, headers={"Retry-After": "1"}))
    async with cluster([prefill], [decode]) as router:
        status, headers, raw = await post(router, "/v1/completions", {"prompt": "hi"})
    assert (status, headers["Retry-After"], msgspec.json.decode(raw), len(decode.bodies)) == (429, "1", OVERLOADED, 1)
    assert "X-Disagg-Retries" not in headers


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prefill_counts_a_leg_as_prefilling_until_it_answers(stream):
    release_prefill, release_decode = asyncio.Event(), asyncio.Event()

    def after(event: asyncio.Event, then):
        async def answer(request: web.Request, body: dict) -> web.StreamResponse:
            await event.wait()
            return await then(request, body)
        return answer

    prefill = FakeServer(after(release_prefill, json_answer({"text": "", "meta_info": {}})))
    decode = FakeServer(after(release_decode, sse_answer(SSE_CHUNKS) if stream else json_answer({"text": "abc"})))
    async with cluster([prefill], [decode]) as router:
        pool = router.router.pool

        def counts() -> tuple[int, int, int]:
            load = pool.loads(Role.PREFILL)[0]
            return load.prefilling, load.in_flight, pool.loads(Role.DECODE)[0].in_flight

        request = asyncio.create_task(post(router, "/generate", {"text": "hi", "stream": stream}))
        await wait_for(lambda: len(decode.bodies) == 1 and len(prefill.bodies) == 1)
        assert counts() == (1, 1, 1)
        async with router.http.get(router.url + "/metrics") as resp:
            gauge = f'disagg_router_prefill_legs_active{{worker="{prefill.url}"}} 1.0'
            assert gauge in (await resp.text()).splitlines()
        release_prefill.set()
        await wait_for(lambda: counts()[0] == 0)
        assert counts() == (0, 1, 1)  # the request is in flight on both until the decode ends it
        release_decode.set()
        status, _, _ = await request
        await wait_for(lambda: counts() == (0, 0, 0))  # a stream's handler ends after its last byte
        assert status == 200
