"""Optional API key: `Authorization: Bearer KEY` on every route except the probes."""

from __future__ import annotations

import hmac

from aiohttp import web

from disagg.api.errors import Unauthorized

OPEN_PATHS = frozenset({"/health", "/metrics"})


def api_key_middleware(api_key: str):
    """A middleware that answers 401 unless the request carries the key (constant-time compare)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_api_key(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            sent = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(sent, expected):
                raise Unauthorized()
        return await handler(request)

    return check_api_key
