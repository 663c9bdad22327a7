"""Our P/D router (sglang-router compatible): pairs one prefill and one decode server per request.

Kept light: importing the package loads neither aiohttp nor torch. Entry points:
`disagg.router.launch` (CLI options, `main`), `disagg.router.server` (`RouterServer`, `run`).
"""
