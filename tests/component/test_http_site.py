"""disagg.http_site over real sockets on 127.0.0.1: the bound port, a failed bind that cleans up, HTTPS
with a throwaway CA (who is served, who is refused, client certificates), and files that do not load."""

import errno
import socket

import aiohttp
import pytest
from aiohttp import web

from disagg.config import ConfigError, TlsConfig
from disagg.http_site import client_ssl_context, server_ssl_context, start_site
from tls_files import write_tls_files

pytestmark = pytest.mark.timeout(30)


async def ping(_request: web.Request) -> web.Response:
    return web.Response(text="pong")


def _app(cleaned: list[str]) -> web.Application:
    app = web.Application()
    app.router.add_get("/ping", ping)

    async def on_cleanup(_app):
        cleaned.append("cleaned")

    app.on_cleanup.append(on_cleanup)
    return app


async def test_port_zero_binds_a_free_port_and_serves_until_cleanup():
    cleaned: list[str] = []
    runner, port = await start_site(_app(cleaned), "127.0.0.1", 0, access_log=None)
    assert port > 0
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/ping") as resp:
            assert (resp.status, await resp.text()) == (200, "pong")
    await runner.cleanup()
    assert cleaned == ["cleaned"]


async def test_a_taken_port_raises_and_the_runner_is_cleaned_up():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cleaned: list[str] = []
        with pytest.raises(OSError) as info:
            await start_site(_app(cleaned), "127.0.0.1", taken.getsockname()[1])
        assert info.value.errno == errno.EADDRINUSE
        assert cleaned == ["cleaned"]


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return write_tls_files(tmp_path_factory.mktemp("tls"))


async def get_ping(port: int, scheme: str = "https", ssl=True) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(f"{scheme}://127.0.0.1:{port}/ping", ssl=ssl) as resp:
        return resp.status, await resp.text()


async def test_https_serves_clients_that_trust_its_ca_and_no_one_else(tls):
    context = server_ssl_context(TlsConfig(ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile))
    runner, port = await start_site(_app([]), "127.0.0.1", 0, context, access_log=None)
    try:
        assert await get_ping(port, ssl=client_ssl_context(tls.ca)) == (200, "pong")
        with pytest.raises(aiohttp.ServerDisconnectedError):  # plain HTTP to the TLS port
            await get_ping(port, "http")
        for untrusting in (client_ssl_context(None), client_ssl_context(tls.other_ca)):  # system store, another CA
            with pytest.raises(aiohttp.ClientConnectorCertificateError) as info:
                await get_ping(port, ssl=untrusting)
            assert info.value.certificate_error.verify_message in (
                "unable to get local issuer certificate", "self-signed certificate in certificate chain")
    finally:
        await runner.cleanup()


async def test_required_client_certificates_refuse_a_client_without_one(tls):
    context = server_ssl_context(TlsConfig(ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile,
                                           ssl_ca_certs=tls.ca, ssl_cert_reqs=2))
    runner, port = await start_site(_app([]), "127.0.0.1", 0, context, access_log=None)
    try:
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await get_ping(port, ssl=client_ssl_context(tls.ca))
        with_cert = client_ssl_context(tls.ca, tls.client_certfile, tls.client_keyfile)
        assert await get_ping(port, ssl=with_cert) == (200, "pong")
    finally:
        await runner.cleanup()


def test_files_that_do_not_load_are_config_errors_naming_the_flag(tls):
    assert server_ssl_context(TlsConfig()) is None
    cases = [
        (lambda: server_ssl_context(TlsConfig(ssl_certfile="/nonexistent/c.pem")),
         "--ssl-certfile /nonexistent/c.pem: cannot load it: [Errno 2] No such file or directory"),
        (lambda: server_ssl_context(TlsConfig(ssl_certfile=tls.certfile, ssl_keyfile=tls.client_keyfile)),
         f"--ssl-certfile {tls.certfile}: cannot load it: [X509: KEY_VALUES_MISMATCH] key values mismatch"),
        (lambda: server_ssl_context(TlsConfig(ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile,
                                              ssl_ca_certs="/nonexistent/ca.pem")),
         "--ssl-ca-certs /nonexistent/ca.pem: cannot load it: [Errno 2] No such file or directory"),
        (lambda: client_ssl_context("/nonexistent/up.pem"),
         "--upstream-ca-certs /nonexistent/up.pem: cannot load it: [Errno 2] No such file or directory"),
        (lambda: client_ssl_context(None, "/nonexistent/rc.pem"),
         "--upstream-certfile /nonexistent/rc.pem: cannot load it: [Errno 2] No such file or directory"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError) as info:
            make()
        assert str(info.value) == message
