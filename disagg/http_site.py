"""Binding an aiohttp application to a port: the one way the API, the router and the registry serve."""

from __future__ import annotations

from aiohttp import web


async def start_site(app: web.Application, host: str, port: int, **runner_options) -> tuple[web.AppRunner, int]:
    """Set `app` up and serve it on host:port (0: any free port); returns the runner
    (`await runner.cleanup()` stops serving) and the bound port. A bind that fails cleans up first."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]
