"""`Cluster`: a prefill server (with its bootstrap registry), a decode server and, unless told
otherwise, our router, on free loopback ports, for a test to drive. The HTTP fronts run in this
process on an event loop of their own (a thread), so sync and async tests alike may call them with
any client; the engine workers are real processes. Nothing here is a mock: the servers are what
`disagg prefill|decode|router` run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import threading
import time
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bootstrap.server import BootstrapServer
from disagg.config import DisaggregationMode, LoadBalanceMethod, ServerConfig
from disagg.pd_config import DisaggConfig, with_settings
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
from disagg.launch import RunningServer, drain_server, start_server
from disagg.router.config import PdProtocol, PrefillEndpoint, RouterConfig
from disagg.router.policy import Policy
from disagg.router.server import RouterServer
from disagg.testing.faults import Faults
from disagg.testing.http import post

HOST = "127.0.0.1"
LEAK_GAUGES = ("disagg_num_free_blocks", "disagg_num_quarantined_blocks", "disagg_num_requests_running",
               "disagg_num_requests_waiting")


def tiny_engine(num_blocks: int = 128, block_size: int = 4) -> EngineConfig:
    """The deterministic tiny model (random weights, seed 0), float32, a small paged cache."""
    return EngineConfig(model=ModelConfig(model="tiny", dtype="float32"),
                        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size))


class Metrics:
    """One scrape of a server's /metrics: `value(name, **labels)` sums the samples that match."""

    def __init__(self, text: str):
        self.text = text
        self.samples = [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
                        for s in family.samples]

    def value(self, name: str, **labels: object) -> float:
        wanted = {k: str(v) for k, v in labels.items()}
        return sum(v for n, ls, v in self.samples if n == name and wanted.items() <= ls.items())

    def by_rank(self, name: str) -> dict[int, float]:
        """A per-DP-rank gauge as {rank: value}."""
        return {int(ls["dp_rank"]): v for n, ls, v in self.samples if n == name and "dp_rank" in ls}


@dataclass(frozen=True)
class Worker:
    """One DP worker as the server's controller sees it: `ready` once it serves requests."""

    rank: int
    pid: int | None
    alive: bool
    ready: bool
    restarts: int


class Server:
    """A running prefill or decode server: `url`, `bootstrap_port` (prefill), `metrics()`,
    `workers()`, `faults` (with `fault_injection=True`), `drain()`, `restart_registry()` (prefill)."""

    def __init__(self, role: str, running: RunningServer, admin_key: str | None, loop: _Loop):
        self.role = role
        self.running = running
        self._loop = loop
        self.url = f"http://{HOST}:{running.port}"
        self.bootstrap_port = running.bootstrap_port
        self.faults = Faults(self.url, admin_key)

    def metrics(self) -> Metrics:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            return Metrics(resp.read().decode())

    def workers(self) -> list[Worker]:
        return [Worker(w.rank, w.process.pid, w.alive and w.process.is_alive(), w.available, w.num_restarts)
                for w in self.running.controller.workers]

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers() if w.pid is not None]

    def drain(self, timeout_s: float = 30.0) -> None:
        """What SIGTERM does to the server (docs/api.md): health red, new requests 503 `draining`,
        requests in flight finish within `timeout_s`; returns once they did. The server stays up,
        refusing, until the cluster stops."""
        self._loop.run(drain_server(self.running, timeout_s), timeout_s + 30)


    def restart_registry(self, wait: bool = True, timeout_s: float = 30.0) -> None:
        """The prefill's bootstrap registry stops and starts again on its port, empty, as a registry
        that restarted; with `wait`, returns once every prefill rank registered again (each does
        every `registry_refresh_s`)."""
        self._loop.run(self._restart_registry(wait, timeout_s), timeout_s + 10)

    async def _restart_registry(self, wait: bool, timeout_s: float) -> None:
        old = self.running.bootstrap
        if old is None:
            raise RuntimeError("the registry lives in the prefill server")
        await old.close()
        fresh = BootstrapServer(old.config)
        await fresh.start(port=old.port)
        self.running.bootstrap = fresh  # closed with the server
        deadline = asyncio.get_running_loop().time() + timeout_s
        while wait and not fresh.registry.is_complete():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the prefill ranks did not register again within {timeout_s} s")
            await asyncio.sleep(0.05)


class _Loop:
    """An event loop on a daemon thread: the servers live there, whoever calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="disagg-testing", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float | None = None) -> Any:
        """`coro`'s result; past `timeout_s` it is cancelled (what it started closes itself) and
        TimeoutError raised."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            concurrent.futures.wait([future], 30)
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Cluster:
    """A P/D cluster for one test, a module or a session. Arguments: `model` ("tiny", or anything
    `--model` takes; `engine` replaces the whole engine config), `prefill_dp` and `decode_dp`,
    `backend` (tcp or nixl), `protocol` (push: SGLang's bootstrap rooms; pull: vLLM's
    kv_transfer_params), `router` (our router in front, with `policy`), `server` / `prefill_server`
    / `decode_server` (ServerConfig fields), `disagg` (DisaggConfig fields), `fault_injection` (the
    servers' fault routes, docs/testing.md), `admin_key` (theirs) and `router_options` (RouterConfig
    fields of our router: `retry_max_retries`, `request_timeout_s`, ...; its health checks run every
    second here unless `health_check_interval_s` says otherwise)."""

    def __init__(self, model: str = "tiny", *, prefill_dp: int = 1, decode_dp: int = 1, backend: str = "tcp",
                 protocol: str = "push", router: bool = True, policy: str = "round_robin",
                 engine: EngineConfig | None = None, server: dict | None = None, prefill_server: dict | None = None,
                 decode_server: dict | None = None, disagg: dict | None = None, fault_injection: bool = False,
                 admin_key: str | None = None, router_options: dict | None = None, start_timeout_s: float = 120.0):
        self.engine = engine or (tiny_engine() if model == "tiny" else EngineConfig(model=ModelConfig(model=model)))
        self.protocol = PdProtocol(protocol)
        self.policy = Policy(policy)
        self.with_router = router
        self.admin_key = admin_key
        self.router_options = {"health_check_interval_s": 1.0, **(router_options or {})}
        self.start_timeout_s = start_timeout_s
        self.disagg = with_settings(DisaggConfig(), **{
            "transfer_backend": backend, "bootstrap_port": 0, "bootstrap_timeout_s": 30, "waiting_timeout_s": 30,
            "cluster_secret": secrets.token_hex(32), **(disagg or {})})
        base = ServerConfig(host=HOST, port=0, admin_key=admin_key, enable_fault_injection=fault_injection,
                            **(server or {}))
        method = LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM if self.protocol is PdProtocol.PUSH else LoadBalanceMethod.LEAST_LOAD
        self.prefill_config = replace(base, dp_size=prefill_dp, disaggregation_mode=DisaggregationMode.PREFILL,
                                      load_balance_method=method, **(prefill_server or {}))
        self.decode_config = replace(base, dp_size=decode_dp, disaggregation_mode=DisaggregationMode.DECODE,
                                     **(decode_server or {}))
        self.log: list[str] = []  # the servers' progress lines
        self.prefill: Server | None = None
        self.decode: Server | None = None
        self.router: RouterServer | None = None
        self._unified: RunningServer | None = None
        self._loop: _Loop | None = None

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start everything (in seconds for the tiny model); on any failure, stop what started and raise."""
        self._loop = _Loop()
        try:
            self._loop.run(self._start(), self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    async def _start(self) -> None:
        def note(line: str) -> None:
            self.log.append(line)

        prefill, decode = await asyncio.gather(
            start_server(self.prefill_config, self.engine, self.disagg, note),
            start_server(self.decode_config, self.engine, self.disagg, note), return_exceptions=True)
        started = [s for s in (prefill, decode) if isinstance(s, RunningServer)]
        if len(started) < 2:
            for server in started:
                await server.close()
            raise next(e for e in (prefill, decode) if isinstance(e, BaseException))
        self.prefill = Server("prefill", prefill, self.admin_key, self._loop)
        self.decode = Server("decode", decode, self.admin_key, self._loop)
        if self.with_router:
            self.router = RouterServer(RouterConfig(
                host=HOST, port=0, prefill=(PrefillEndpoint(self.prefill.url, self.prefill.bootstrap_port),),
                decode=(self.decode.url,), policy=self.policy, protocol=self.protocol, **self.router_options))
            await self.router.start()

    def stop(self) -> None:
        """Stop the router, the servers and the reference server; every worker process is gone after."""
        if self._loop is None:
            return
        try:
            self._loop.run(self._stop(), 120)
        finally:
            self._loop.close()
            self._loop = None

    async def _stop(self) -> None:
        if self.router is not None:
            await self.router.close()
        closing = [s.running.close() for s in self.servers]
        if self._unified is not None:
            closing.append(self._unified.close())
        await asyncio.gather(*closing, return_exceptions=True)

    @staticmethod
    def across_namespaces(**options: object):
        """The cluster with our router, a standalone registry, the prefill and the decode each in a
        network namespace of its own, on addresses that are not loopback (disagg/testing/netns.py:
        NetnsCluster, whose `options` these are; Linux and root)."""
        from disagg.testing.netns import NetnsCluster  # it reads this module's checks
        return NetnsCluster(**options)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> Cluster:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.stop)

    # ---- what a test reads --------------------------------------------------------------------

    @property
    def servers(self) -> list[Server]:
        return [s for s in (self.prefill, self.decode) if s is not None]

    @property
    def router_url(self) -> str:
        if self.router is None:
            raise RuntimeError("this cluster runs without a router (router=False)")
        return self.router.url

    def pids(self) -> list[int]:
        """Every engine worker process of the cluster (and of the reference server)."""
        pids = [pid for s in self.servers for pid in s.pids()]
        if self._unified is not None:
            pids += [w.process.pid for w in self._unified.controller.workers]
        return pids

    def reference(self, path: str, body: dict) -> Any:
        """What a unified server with the same engine answers to `body` at `path` (JSON, or the SSE
        text of a stream): the output a P/D answer must equal. Started on first use."""
        if self._loop is None:
            raise RuntimeError("the cluster is not running")
        if self._unified is None:
            self._unified = self._loop.run(start_server(ServerConfig(host=HOST, port=0, dp_size=1), self.engine,
                                                        DisaggConfig(), self.log.append), self.start_timeout_s)
        return post(f"http://{HOST}:{self._unified.port}{path}", body)[1]

    def assert_no_leaks(self, timeout_s: float = 10.0) -> None:
        """Within `timeout_s`, every worker of both servers back to where it started: all its KV
        blocks free (cached ones count: they are free to evict), none quarantined, nothing running
        or waiting. AssertionError naming each gauge that is not, otherwise."""
        wait_no_leaks(self.servers, timeout_s)


def wait_no_leaks(servers, timeout_s: float) -> None:
    """Return once no server (anything with `role` and `metrics()`) `leaks`; AssertionError at `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [problem for s in servers for problem in leaks(s.role, s.metrics())]
        if not left:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"not back to start after {timeout_s} s: " + "; ".join(left))
        time.sleep(0.1)


def leaks(role: str, metrics: Metrics) -> list[str]:
    """What keeps a server's workers from their starting state, one line per gauge and rank."""
    total = metrics.by_rank("disagg_num_total_blocks")
    wanted = {"disagg_num_free_blocks": total, **{g: dict.fromkeys(total, 0.0) for g in LEAK_GAUGES[1:]}}
    return [f"{role} dp_rank {rank}: {gauge} {value:g}, expected {want[rank]:g}"
            for gauge, want in wanted.items() for rank, value in sorted(metrics.by_rank(gauge).items())
            if value != want.get(rank)]

