"""Start prefill, decode and unified servers in-process (their engine workers are real processes)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, replace

import aiohttp

from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig, with_settings
from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.launch import RunningServer, start_server

TINY = EngineConfig(
    model=ModelConfig(model="tiny", dtype="float32"),
    cache=CacheConfig(num_blocks=96, block_size=4),
    scheduler=SchedulerConfig(max_num_batched_tokens=16),  # prompts over 16 tokens are chunked
)


@dataclass
class Cluster:
    prefill: RunningServer
    decode: RunningServer
    session: aiohttp.ClientSession

    @property
    def prefill_url(self) -> str:
        return f"http://127.0.0.1:{self.prefill.port}"

    @property
    def decode_url(self) -> str:
        return f"http://127.0.0.1:{self.decode.port}"

    def pd_body(self, body: dict, room: int | None = None) -> dict:
        room = random.getrandbits(63) if room is None else room
        return dict(body, bootstrap_host="127.0.0.1", bootstrap_port=self.prefill.bootstrap_port, bootstrap_room=room)

    async def post_both(self, path: str, prefill_body: dict, decode_body: dict, headers=(None, None)):
        """Both legs at once, as a router does; returns (prefill, decode) as (status, json-or-text, headers)."""
        legs = await asyncio.gather(
            self.post(self.prefill_url + path, prefill_body, headers[0]),
            self.post(self.decode_url + path, decode_body, headers[1]),
        )
        return legs

    async def post(self, url: str, body: dict, headers):
        async with self.session.post(url, json=body, headers=headers) as resp:
            text = await resp.text()
            data = await resp.json(content_type=None) if not body.get("stream") else text
            return resp.status, data, resp.headers

    async def free_blocks(self) -> tuple[list[int], list[int]]:
        stats = [await s.controller.call_utility("stats") for s in (self.prefill, self.decode)]
        return [w.num_free_blocks for w in stats[0]], [w.num_free_blocks for w in stats[1]]

    async def decode_kv_bytes(self) -> float:
        """The decode server's `disagg_kv_transfer_bytes_total`: KV bytes it received so far."""
        async with self.session.get(self.decode_url + "/metrics") as r:
            lines = (await r.text()).splitlines()
        return next((float(line.split()[1]) for line in lines if line.startswith("disagg_kv_transfer_bytes_total ")), 0.0)

    async def settled(self, expected: tuple, timeout_s: float = 5.0) -> tuple[list[int], list[int]]:
        """`free_blocks()` once it reads `expected` (polled until `timeout_s`), else its last reading."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (blocks := await self.free_blocks()) != expected and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        return blocks

    async def close(self) -> None:
        await self.session.close()
        await asyncio.gather(self.prefill.close(), self.decode.close())


@contextlib.asynccontextmanager
async def counting_listener():
    """A TCP listener on a free loopback port that closes what it accepts; yields (port, the list of
    accepted connections), so a test can assert that nothing connected."""
    accepted = []
    server = await asyncio.start_server(lambda reader, writer: accepted.append(writer.close()), "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1], accepted


async def until(condition, what: str, action=None) -> None:
    """Poll `condition` (awaiting `action` between tries) for up to 10 s; fails naming `what`."""
    for _ in range(100):
        if condition():
            return
        if action is not None:
            await action()
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def pd_config(backend: str, force_query: bool = False, **options) -> DisaggConfig:
    return with_settings(DisaggConfig(), **{
        "transfer_backend": backend, "bootstrap_port": 0, "force_query_prefill_dp_rank": force_query,
        "bootstrap_timeout_s": 30, "waiting_timeout_s": 30, **options})


async def start_decode(disagg: DisaggConfig, engine: EngineConfig = TINY, dp_size: int = 2,
                       server: dict | None = None) -> RunningServer:
    config = ServerConfig(port=0, dp_size=dp_size, disaggregation_mode="decode", **(server or {}))
    return await start_server(config, engine, disagg, lambda _: None)


async def start_pd(backend: str, force_query: bool = False, engine: EngineConfig = TINY,
                   prefill_method: str = "follow_bootstrap_room", cluster_secret: str | None = None,
                   decode_options: dict | None = None, server: dict | None = None, disagg: dict | None = None,
                   dp_size: int = 2) -> Cluster:
    """Prefill and decode servers (`dp_size` workers each) sharing `cluster_secret` (None: none, whatever the
    environment says). `server` / `disagg` override config fields of both (fault tests set short
    deadlines there; `disagg["control"]` holds the control plane's timings), `decode_options` the decode's."""
    disagg_config = pd_config(backend, force_query, cluster_secret=cluster_secret, **(disagg or {}))
    base = ServerConfig(port=0, dp_size=dp_size, **(server or {}))
    prefill, decode = await asyncio.gather(
        start_server(replace(base, load_balance_method=prefill_method, disaggregation_mode="prefill"), engine,
                     disagg_config, lambda _: None),
        start_decode(with_settings(disagg_config, **(decode_options or {})), engine, dp_size, server=server),
    )
    return Cluster(prefill, decode, aiohttp.ClientSession())


async def start_tp_pd(backend: str, prefill_tp: int, decode_tp: int, server: dict | None = None,
                      engine: EngineConfig = TINY, disagg: dict | None = None) -> Cluster:
    """A prefill and a decode server, dp 1 each, whose worker is a TP group of `prefill_tp` and
    `decode_tp` processes (`engine`: the tiny model); `server` and `disagg` override config fields of both."""
    disagg = pd_config(backend, **(disagg or {}))
    prefill, decode = await asyncio.gather(
        start_server(ServerConfig(port=0, dp_size=1, disaggregation_mode="prefill", **(server or {})),
                     replace(engine, tensor_parallel_size=prefill_tp), disagg, lambda _: None),
        start_decode(disagg, replace(engine, tensor_parallel_size=decode_tp), dp_size=1, server=server),
    )
    return Cluster(prefill, decode, aiohttp.ClientSession())


async def start_unified(engine: EngineConfig = TINY) -> RunningServer:
    return await start_server(ServerConfig(port=0, dp_size=1), engine, DisaggConfig(), lambda _: None)


async def unified_answer(cluster: Cluster, unified: RunningServer, prompt: list[int]) -> tuple[str, list[int]]:
    """The unified server's greedy 12-token answer to a token-id prompt: its text (/v1/completions)
    and its token ids (/generate), the reference of a P/D answer and the next turn's history."""
    url = f"http://127.0.0.1:{unified.port}"
    greedy = {"temperature": 0, "ignore_eos": True}
    _, completion, _ = await cluster.post(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 12, **greedy}, None)
    sampling = {"max_new_tokens": 12, **greedy}
    _, generated, _ = await cluster.post(url + "/generate", {"input_ids": prompt, "sampling_params": sampling}, None)
    return completion["choices"][0]["text"], generated["output_ids"]
