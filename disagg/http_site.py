"""Binding an aiohttp application to a port: the one way the API, the router and the registry serve,
over plain HTTP or HTTPS; and the TLS contexts of the fronts and of the router's upstream calls."""

from __future__ import annotations

import re
import ssl

from aiohttp import web

from disagg.config import ConfigError, TlsConfig


async def start_site(app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                     **runner_options) -> tuple[web.AppRunner, int]:
    """Set `app` up and serve it on host:port (0: any free port), over HTTPS with `ssl_context`;
    returns the runner (`await runner.cleanup()` stops serving) and the bound port. A bind that fails
    cleans up first."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=ssl_context).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


def _load(flag: str, path: str, load, *args) -> None:
    try:
        load(path, *args)
    except OSError as exc:  # ssl.SSLError too: not PEM, a key that does not match
        reason = re.sub(r" \(_ssl\.c:\d+\)$", "", str(exc))  # OpenSSL's words without the C source line
        raise ConfigError(f"{flag} {path}: cannot load it: {reason}") from None


def server_ssl_context(tls: TlsConfig) -> ssl.SSLContext | None:
    """The context of an HTTPS front (None: plain HTTP): its certificate and key, and with
    `ssl_ca_certs` the CAs that verify client certificates (`ssl_cert_reqs`: none, optional, required).
    A file that does not load is a ConfigError naming its flag, raised before anything binds."""
    if not tls.enabled:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _load("--ssl-certfile", tls.ssl_certfile, context.load_cert_chain, tls.ssl_keyfile)
    if tls.ssl_ca_certs is not None:
        _load("--ssl-ca-certs", tls.ssl_ca_certs, context.load_verify_locations)
    context.verify_mode = ssl.VerifyMode(tls.ssl_cert_reqs)
    return context


def client_ssl_context(ca_certs: str | None, certfile: str | None = None, keyfile: str | None = None) -> ssl.SSLContext:
    """The context of the router's calls to https:// servers: their certificates and host names are
    verified against `ca_certs` (`--upstream-ca-certs`, a PEM bundle; None: the system's trust store),
    and with `certfile` (and `keyfile`) the router shows a client certificate (servers started with
    `--ssl-cert-reqs 2` ask for one)."""
    context = ssl.create_default_context()
    if ca_certs is not None:
        _load("--upstream-ca-certs", ca_certs, context.load_verify_locations)
    if certfile is not None:
        _load("--upstream-certfile", certfile, context.load_cert_chain, keyfile)
    return context
