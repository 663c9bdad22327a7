"""A prefill that registers with a standalone bootstrap registry (`--external-registry`, the
`disagg bootstrap` of another process) instead of running one: its ranks appear there, it runs none
itself, and our router, told the registry's address (`--prefill URL HOST:PORT`), sends rooms that
name it; the answers equal unified's. A switchable server cannot use one (its switch clears its ranks)."""

import secrets

import aiohttp
import pytest

from bootstrap.server import BootstrapServer
from disagg.config import ConfigError, ServerConfig
from disagg.launch import start_server
from disagg.registry_config import BootstrapConfig
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import TINY, pd_config, start_decode, start_unified

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
BODY = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}


async def test_a_prefill_registered_with_a_standalone_registry_serves_through_the_router():
    secret = secrets.token_hex(16)
    registry = BootstrapServer(BootstrapConfig(port=0, cluster_secret=secret))
    port = await registry.start()
    disagg = pd_config("tcp", cluster_secret=secret, bootstrap_port=port, external_registry=True)
    servers, router = [], None
    try:
        servers.append(await start_server(ServerConfig(port=0, dp_size=2, disaggregation_mode="prefill"), TINY, disagg,
                                          lambda _: None))
        servers.append(await start_decode(disagg))
        servers.append(await start_unified())
        prefill, decode, unified = servers
        assert prefill.bootstrap is None and registry.registry.is_complete()  # both prefill ranks registered there
        router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(f"http://127.0.0.1:{decode.port}",),
                                           prefill=(PrefillEndpoint(f"http://127.0.0.1:{prefill.port}", port,
                                                                    "localhost"),)))
        await router.start()
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{unified.port}/v1/completions", json=BODY) as r:
                want = (await r.json())["choices"][0]["text"]
            for _ in range(4):  # rooms on both prefill ranks
                async with session.post(router.url + "/v1/completions", json=BODY) as r:
                    assert (r.status, (await r.json())["choices"][0]["text"]) == (200, want)
            async with session.get(router.url + "/workers") as r:
                [entry] = (await r.json())["prefill"]
            assert (entry["bootstrap_host"], entry["bootstrap_port"]) == ("localhost", port)
    finally:
        if router is not None:
            await router.close()
        for server in servers:
            await server.close()
        await registry.close()


async def test_a_switchable_server_needs_its_own_registry():
    disagg = pd_config("tcp", external_registry=True)
    config = ServerConfig(port=0, dp_size=1, disaggregation_mode="decode", enable_pd_role_switch=True)
    with pytest.raises(ConfigError, match="--enable-pd-role-switch needs the server's own bootstrap registry"):
        await start_server(config, TINY, disagg, lambda _: None)
