"""HTTPS on the fronts, end to end (real workers, a throwaway CA): the openai SDK trusting the CA gets
from a TLS unified server exactly what the plain server answers, and nothing over plain HTTP or
without the CA; the router serves HTTPS in front of a P/D pair that serves HTTPS too, trusting their
CA through --upstream-ca-certs, and finds no healthy server without it."""

import httpx2
import openai
import pytest
import pytest_asyncio

from disagg.config import ServerConfig, TlsConfig
from disagg.http_site import client_ssl_context
from disagg.launch import start_server
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from pd_cluster import TINY, start_pd
from tls_files import write_tls_files

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
PROMPT = "The quick brown fox jumps over the lazy dog, twice: " * 2  # chunked prefill on the P/D pair
GREEDY = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return write_tls_files(tmp_path_factory.mktemp("tls"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tls_unified(tls):
    config = ServerConfig(port=0, dp_size=1, tls=TlsConfig(ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile))
    running = await start_server(config, TINY, progress=lambda _: None)
    yield running
    await running.close()


def sdk(base_url: str, verify) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                              http_client=httpx2.AsyncClient(verify=verify))


async def complete(base_url: str, verify=True) -> tuple[str, int]:
    async with sdk(base_url, verify) as client:
        answer = await client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
    return answer.choices[0].text, answer.usage.completion_tokens


async def test_the_openai_sdk_trusting_the_ca_gets_what_the_plain_server_answers(tls, tls_unified, unified_url):
    expected = await complete(unified_url)
    assert expected[1] == 12
    assert await complete(f"https://localhost:{tls_unified.port}", client_ssl_context(tls.ca)) == expected
    async with sdk(f"https://127.0.0.1:{tls_unified.port}", client_ssl_context(tls.ca)) as client:
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    async with sdk(unified_url, True) as client:
        plain = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], **GREEDY)
    assert chat.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("scheme, trusted", [("http", True), ("https", False)], ids=["plain-http", "ca-not-trusted"])
async def test_no_answer_over_plain_http_or_without_the_ca(tls, tls_unified, scheme, trusted):
    verify = client_ssl_context(tls.ca) if trusted else client_ssl_context(tls.other_ca)
    with pytest.raises(openai.APIConnectionError):
        await complete(f"{scheme}://127.0.0.1:{tls_unified.port}", verify)


async def test_the_router_serves_https_in_front_of_https_servers(tls, unified_url):
    server_tls = TlsConfig(ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile)
    cluster = await start_pd("tcp", dp_size=1, server={"tls": server_tls})
    prefill = (PrefillEndpoint(f"https://127.0.0.1:{cluster.prefill.port}", cluster.prefill.bootstrap_port),)
    decode = (f"https://127.0.0.1:{cluster.decode.port}",)
    try:
        config = RouterConfig(port=0, prefill=prefill, decode=decode, tls=server_tls, upstream_ca_certs=tls.ca)
        async with RouterServer(config) as router:
            assert router.url.startswith("https://127.0.0.1:")
            assert await complete(router.url, client_ssl_context(tls.ca)) == await complete(unified_url)
        untrusting = RouterConfig(port=0, prefill=prefill, decode=decode)  # the system's trust store
        async with RouterServer(untrusting) as router, sdk(router.url, True) as client:
            with pytest.raises(openai.APIStatusError) as info:
                await client.completions.create(model="tiny", prompt=PROMPT, **GREEDY)
            assert (info.value.status_code, info.value.body["message"]) == (503, "no healthy prefill server")
    finally:
        await cluster.close()
