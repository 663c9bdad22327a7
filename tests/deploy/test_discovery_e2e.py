"""End to end: `disagg router --service-discovery` (a real process) in front of two prefill and two
decode servers (real `disagg prefill|decode` processes, tiny model, tcp KV transfer), announced one by
one through the fake Kubernetes API. Requests flow the whole time; a prefill joins and a decode is
drained the way Kubernetes does it (deletionTimestamp and SIGTERM at once): no request fails, and
every answer is the same greedy text."""

import asyncio
import contextlib
import re
import signal
import time

import aiohttp
import pytest

from backends import DECODE_LABELS, PREFILL_LABELS
from cli_process import start_cli
from fake_kube import ready_pod

pytestmark = pytest.mark.timeout(180)
BODY = {"text": "hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


class Process:
    """`disagg ARGS` from this checkout, read up to its ready line; the rest of its output is drained
    (so a full pipe never blocks it) and kept for failure messages."""

    def __init__(self, proc: asyncio.subprocess.Process, ready: str):
        self.proc = proc
        self.ready = ready
        self.url = ready.split()[1]
        self.port = int(self.url.rsplit(":", 1)[1])
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._drain())

    @classmethod
    async def start(cls, *args: str) -> "Process":
        proc, lines = await start_cli(*args, stderr=asyncio.subprocess.STDOUT)
        return cls(proc, lines[-1])

    async def _drain(self) -> None:
        while line := await self.proc.stdout.readline():
            self.lines.append(line.decode())

    @property
    def bootstrap_port(self) -> int:
        return int(re.search(r"bootstrap_port=(\d+)", self.ready)[1])

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await self._reader


@contextlib.asynccontextmanager
async def processes(*starts):
    """Start them all at once; every one is killed on the way out, whatever happened."""
    results = await asyncio.gather(*starts, return_exceptions=True)
    started = [r for r in results if isinstance(r, Process)]
    try:
        for r in results:
            if isinstance(r, BaseException):
                raise r
        yield started
    finally:
        for p in started:
            await p.stop()


async def served_generates(http: aiohttp.ClientSession, url: str) -> int:
    """How many /generate requests the server answered 200 (its Prometheus counter)."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    found = re.search(r'disagg_requests_total\{endpoint="/generate",status="200"\} (\d+)', text)
    return int(found[1]) if found else 0


async def until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)


async def client(http: aiohttp.ClientSession, url: str, results: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        async with http.post(url + "/generate", json=BODY) as resp:
            results.append((resp.status, await resp.json(content_type=None)))


async def test_requests_flow_while_a_prefill_joins_and_a_decode_drains(kube, tmp_path):
    server = ("--model", "tiny", "--port", "0", "--transfer-backend", "tcp", "--shutdown-timeout-s", "20")
    async with processes(Process.start("prefill", *server, "--bootstrap-port", "0"),
                         Process.start("prefill", *server, "--bootstrap-port", "0"),
                         Process.start("decode", *server), Process.start("decode", *server)) as (p0, p1, d0, d1):
        kube.put(ready_pod("p0", p0.port, PREFILL_LABELS, bootstrap_port=p0.bootstrap_port))
        kube.put(ready_pod("d0", d0.port, DECODE_LABELS))
        kube.put(ready_pod("d1", d1.port, DECODE_LABELS))
        router_args = ("router", "--host", "127.0.0.1", "--port", "0", "--service-discovery",
                       "--prefill-selector", "app=disagg", "role=prefill", "--decode-selector", "app=disagg role=decode",
                       "--service-discovery-namespace", "disagg", "--kubeconfig", kube.write_kubeconfig(tmp_path / "kc"),
                       "--health-check-interval-s", "0.5", "--service-discovery-backoff-s", "0.05")
        async with processes(Process.start(*router_args)) as (router,), aiohttp.ClientSession() as http:
            async def router_sees(num_prefill: int, num_decode: int) -> bool:
                async with http.get(router.url + "/health") as resp:
                    health = await resp.json(content_type=None)
                return health.get("healthy_prefill") == num_prefill and health.get("healthy_decode") == num_decode

            await until(lambda: router_sees(1, 2), 10, "the router finds p0, d0 and d1")
            results: list = []
            stop = asyncio.Event()
            clients = [asyncio.create_task(client(http, router.url, results, stop)) for _ in range(3)]
            try:
                await until(lambda: _at_least(results, 6), 30, "requests flow")
                kube.put(ready_pod("p1", p1.port, PREFILL_LABELS, bootstrap_port=p1.bootstrap_port))
                await until(lambda: _served(http, p1, 3), 30, "the new prefill serves")
                await until(lambda: _served(http, d0, 3), 30, "d0 serves")
                kube.put(ready_pod("d0", d0.port, DECODE_LABELS, deleting=True))
                d0.proc.send_signal(signal.SIGTERM)  # what the kubelet does when the pod is deleted
                assert await asyncio.wait_for(d0.proc.wait(), 30) == 0
                kube.delete("d0")
                before = await served_generates(http, d1.url)
                await until(lambda: _served(http, d1, before + 6), 30, "d1 alone serves on")
            finally:
                stop.set()
                await asyncio.gather(*clients)
            assert await router_sees(2, 1)
    statuses = [status for status, _ in results]
    assert statuses == [200] * len(results), [r for r in results if r[0] != 200][:3]
    assert len({answer["text"] for _, answer in results}) == 1  # the same greedy text from every pair
    assert len(results) >= 12


async def _at_least(results: list, count: int) -> bool:
    return len(results) >= count


async def _served(http: aiohttp.ClientSession, server: Process, count: int) -> bool:
    return await served_generates(http, server.url) >= count
