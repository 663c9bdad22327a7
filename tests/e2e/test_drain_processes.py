"""SIGTERM on real `disagg unified|prefill|decode` processes (tiny model): health red, new requests
refused, in-flight requests finish (a prefill's decode still gets its KV through the registry), what
outlives the shutdown timeout ends with an error, and every process exits 0."""

import asyncio
import contextlib
import json
import random
import re
import signal
import time

import aiohttp
import pytest
from cli_process import ready_url, start_cli

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
REFUSED = {"error": {"message": "server is draining: it accepts no new requests", "type": "ServiceUnavailableError",
                     "param": None, "code": "draining"}}
GREEDY = {"temperature": 0, "ignore_eos": True}
USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


async def start(*args: str) -> tuple[asyncio.subprocess.Process, str, str]:
    """`disagg ARGS` from this checkout; (process, base URL, its stdout up to the ready line)."""
    proc, lines = await start_cli(*args, timeout_s=60)
    return proc, ready_url(lines), "".join(lines)


@contextlib.asynccontextmanager
async def running(*procs: asyncio.subprocess.Process):
    """Kill whatever a failed test leaves running."""
    try:
        yield
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def wait_until_draining(http: aiohttp.ClientSession, url: str) -> tuple[int, object]:
    """/health once the process handled its signal (it arrives asynchronously); bounded."""
    deadline = time.monotonic() + 5
    while True:
        async with http.get(url + "/health") as resp:
            answer = resp.status, await resp.json(content_type=None) if resp.status != 200 else None
        if answer[0] != 200 or time.monotonic() > deadline:
            return answer
        await asyncio.sleep(0.01)


async def refused(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, object]:
    async with http.post(url + "/generate", json=body) as resp:
        return resp.status, await resp.json()


def events(raw: bytes) -> list:
    found = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            data = block.removeprefix("data: ")
            found.append(data if data == "[DONE]" else json.loads(data))
    return found


def completion_tokens(stream: list) -> tuple[int, str | None]:
    """(tokens streamed, last finish_reason) of an OpenAI completions stream with continuous usage."""
    chunks = [e for e in stream if isinstance(e, dict) and e.get("choices")]
    return chunks[-1]["usage"]["completion_tokens"], chunks[-1]["choices"][0]["finish_reason"]


async def test_unified_sigterm_finishes_the_stream_refuses_new_requests_and_exits_0():
    proc, url, out = await start("unified", "--model", "tiny", "--port", "0", "--shutdown-timeout-s", "30")
    assert f"ready: {url} mode=unified model=tiny dp_size=1" in out  # the mode by name, not "null"
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "stream": True, **GREEDY, **USAGE}
    async with running(proc), aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as resp:
            first = await resp.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert await wait_until_draining(http, url) == (503, REFUSED)
            assert await refused(http, url, {"text": "new", "sampling_params": {"max_new_tokens": 2}}) == (503, REFUSED)
            rest = await resp.read()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        exited_s = time.monotonic() - signalled
    stream = events(first + rest)
    assert (completion_tokens(stream), stream[-1]) == ((400, "length"), "[DONE]")
    assert exited_s < 30


async def test_unified_shutdown_timeout_shorter_than_the_stream_ends_it_with_an_error():
    # 480 tokens take the tiny model over 0.2 s on this project's fastest CPUs: well past a 0.05 s grace.
    proc, url, _ = await start("unified", "--model", "tiny", "--port", "0", "--shutdown-timeout", "0.05")
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 480, "stream": True, **GREEDY, **USAGE}
    async with running(proc), aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as resp:
            first = await resp.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = await resp.read()
            aborted_s = time.monotonic() - signalled
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        exited_s = time.monotonic() - signalled
    *tokens, error, done = events(first + rest)
    assert (error, done) == ({"error": {
        "message": "server shut down before the request finished (shutdown timeout 0.05 s)",
        "type": "ServiceUnavailableError", "param": None, "code": "shutdown"}}, "[DONE]")
    num_tokens, finish_reason = completion_tokens(tokens)
    assert 1 <= num_tokens < 480 and finish_reason is None
    assert 0.05 <= aborted_s < 2.0
    assert exited_s < 5.0  # the grace, then closing the HTTP site and the worker


async def test_pd_sigterm_prefill_still_serves_kv_and_decode_finishes_its_stream():
    (prefill, prefill_url, ready), (decode, decode_url, _) = await asyncio.gather(
        start("prefill", "--model", "tiny", "--port", "0", "--bootstrap-port", "0", "--transfer-backend", "tcp"),
        start("decode", "--model", "tiny", "--port", "0", "--transfer-backend", "tcp"))
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": int(re.search(r"bootstrap_port=(\d+)", ready)[1]),
          "bootstrap_room": random.getrandbits(63)}
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 400, **GREEDY}, **pd}
    async with running(prefill, decode), aiohttp.ClientSession() as http:
        # The prefill leg alone: in flight on the prefill, which waits for its decode's destination blocks.
        prefill_leg = asyncio.create_task(http.post(prefill_url + "/generate", json=body))
        await wait_for_outstanding(http, prefill_url)
        prefill.send_signal(signal.SIGTERM)
        assert await wait_until_draining(http, prefill_url) == (503, REFUSED)
        assert await refused(http, prefill_url, body) == (503, REFUSED)
        # The decode leg arrives after the SIGTERM: it finds the prefill through the registry, still up.
        async with http.post(decode_url + "/generate", json=dict(body, stream=True)) as resp:
            first = await resp.content.readuntil(b"\n\n")  # the KV arrived: the decode generates
            decode.send_signal(signal.SIGTERM)
            assert await wait_until_draining(http, decode_url) == (503, REFUSED)
            assert await refused(http, decode_url, body) == (503, REFUSED)
            rest = await resp.read()
        async with await prefill_leg as answer:
            assert (answer.status, (await answer.json())["meta_info"]["completion_tokens"]) == (200, 1)
        assert await asyncio.wait_for(prefill.wait(), 30) == 0
        assert await asyncio.wait_for(decode.wait(), 30) == 0
    *outputs, done = events(first + rest)
    assert (len(outputs[-1]["output_ids"]), outputs[-1]["meta_info"]["finish_reason"], done) == (
        400, {"type": "length", "length": 400}, "[DONE]")


async def wait_for_outstanding(http: aiohttp.ClientSession, url: str) -> None:
    """Until the server's DP worker holds one request (bounded)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        async with http.get(url + "/server_info") as resp:
            if [s["num_outstanding_requests"] for s in (await resp.json())["internal_states"]] == [1]:
                return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{url} never took the request")


async def test_disagg_serve_drains_the_router_before_prefill_and_decode_then_exits_0():
    proc, url, out = await start("serve", "--model", "tiny", "--port", "0", "--dp-size", "1", "--transfer-backend", "tcp")
    decode_url = re.search(r"decode (http://\S+)", out)[1]
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 400, "stream": True, **GREEDY, **USAGE}
    async with running(proc), aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json=body) as resp:
            first = await resp.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            assert await wait_until_draining(http, url) == (503, {"error": {
                "message": "router is draining: it accepts no new requests", "type": "ServiceUnavailableError",
                "param": None, "code": "draining"}})
            async with http.get(decode_url + "/health") as health:
                assert health.status == 200  # the router drains first: its stream still runs there
            rest = await resp.read()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    stream = events(first + rest)
    assert (completion_tokens(stream), stream[-1]) == ((400, "length"), "[DONE]")


async def pull_ticket(http: aiohttp.ClientSession, prefill_url: str, body: dict) -> dict:
    """The prefill leg of the pull flow: its one-token answer carries the ticket (a lease on its blocks)."""
    async with http.post(prefill_url + "/v1/completions",
                         json=dict(body, max_tokens=1, kv_transfer_params={"do_remote_decode": True})) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["kv_transfer_params"]


async def test_a_draining_prefill_serves_the_read_of_a_ticket_it_issued_then_exits_0():
    (prefill, prefill_url, _), (decode, decode_url, _) = await asyncio.gather(
        start("prefill", "--model", "tiny", "--port", "0", "--bootstrap-port", "0", "--transfer-backend", "tcp",
              "--shutdown-timeout-s", "30"),
        start("decode", "--model", "tiny", "--port", "0", "--transfer-backend", "tcp"))
    body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 8, **GREEDY}
    async with running(prefill, decode), aiohttp.ClientSession() as http:
        ticket = await pull_ticket(http, prefill_url, body)
        prefill.send_signal(signal.SIGTERM)
        assert await wait_until_draining(http, prefill_url) == (503, REFUSED)
        await asyncio.sleep(0.5)
        assert prefill.returncode is None  # no request in flight, but a lease out: still serving reads
        async with http.post(decode_url + "/v1/completions", json=dict(body, kv_transfer_params=ticket)) as resp:
            answer = resp.status, await resp.json()
        released = time.monotonic()
        assert await asyncio.wait_for(prefill.wait(), 30) == 0
        exited_s = time.monotonic() - released
        decode.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(decode.wait(), 30) == 0
    assert (answer[0], answer[1]["usage"]["completion_tokens"], answer[1]["choices"][0]["finish_reason"]) == (200, 8, "length")
    assert exited_s < 2  # the release ended the wait, not the 30 s timeout


@pytest.mark.parametrize("lease_s, timeout_s", [(2.5, 30.0), (30.0, 2.5)], ids=["lease-expires", "shutdown-timeout"])
async def test_a_draining_prefill_waits_for_an_unclaimed_lease_until_it_expires_or_the_timeout(lease_s, timeout_s):
    prefill, prefill_url, _ = await start("prefill", "--model", "tiny", "--port", "0", "--bootstrap-port", "0",
                                          "--transfer-backend", "tcp", "--kv-lease-s", str(lease_s),
                                          "--shutdown-timeout-s", str(timeout_s))
    body = {"model": "tiny", "prompt": "hello there", **GREEDY}
    async with running(prefill), aiohttp.ClientSession() as http:
        await pull_ticket(http, prefill_url, body)
        prefill.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert await asyncio.wait_for(prefill.wait(), 30) == 0
        exited_s = time.monotonic() - signalled
    assert 2.5 <= exited_s < 5.0, exited_s  # the 2.5 s lease or timeout, then closing the workers (< 2 s without a lease)


@pytest.mark.parametrize("role", ["prefill", "decode", "unified"])
async def test_sigterm_to_the_whole_process_group_stops_every_process_at_once(role):
    """systemd's default stop (and `kill -TERM -PGID`) signals the workers too: they leave the stop to
    their front, which drains and stops them in order; nothing dies and is restarted on the way out
    (a prefill took 14 s before)."""
    import os

    extra = ["--bootstrap-port", "0"] if role == "prefill" else []
    proc, lines = await start_cli(role, "--model", "tiny", "--port", "0", *extra, timeout_s=60, new_session=True,
                                  stderr=asyncio.subprocess.STDOUT)
    async with running(proc):
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        rest = (await asyncio.wait_for(proc.stdout.read(), 30)).decode()
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert time.monotonic() - started < 5, rest[-2000:]
        assert "DP worker died" not in rest and "restarting DP worker" not in rest, rest[-2000:]
        for _ in range(100):  # no process of its group outlives it by long (a worker exits once its front left)
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"processes of the group of {role} remain 5 s after it exited")
