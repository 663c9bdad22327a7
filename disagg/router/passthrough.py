"""The routes the router answers from one healthy server, as sgl-model-gateway and vllm-router do:
`/v1/models`, `/version`, `/get_model_info`, `/tokenizer_info` and `/get_server_info` (GET), `/tokenize` and
`/detokenize` (POST). The first eligible decode server answers (every server runs the same model);
its status, content type and body are passed through, the client's Authorization header goes on.
`/get_server_info` is that server's, with the router's own view added under `"router"`.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import msgspec
from aiohttp import web

from disagg.router.errors import NoHealthyServer
from disagg.router.legs import Leg, leg_errors
from disagg.router.workers import Role

GET_PATHS = ("/v1/models", "/v1/models/{model_id:.+}", "/version", "/get_model_info", "/tokenizer_info")
POST_PATHS = ("/tokenize", "/detokenize")


def authorization(request: web.Request) -> dict[str, str]:
    """The client's Authorization header, passed on to the servers (they may share the API key)."""
    return {k: v for k, v in request.headers.items() if k.lower() == "authorization"}


async def send(router, role: Role, server: str, method: str, path: str, headers: dict[str, str],
               body: bytes = b"") -> tuple[int, str, bytes]:
    """`method` `server + path` within the request timeout: (status, content type, body)."""
    leg = Leg(role, -1, server, server + path, body)
    timeout = aiohttp.ClientTimeout(total=router.config.request_timeout_s, connect=router.config.connect_timeout_s)
    if body:
        headers = {**headers, "Content-Type": "application/json"}
    with leg_errors(leg, router.config.request_timeout_s):
        async with router.session.request(method, leg.url, data=body or None, headers=headers, timeout=timeout) as resp:
            return resp.status, resp.headers.get("Content-Type", "application/json"), await resp.read()


async def _from_a_decode(router, request: web.Request) -> tuple[int, str, bytes]:
    index = router.pool.first_eligible(Role.DECODE)
    if index is None:
        raise NoHealthyServer("decode")
    body = await request.read() if request.method == "POST" else b""
    return await send(router, Role.DECODE, router.pool.info(Role.DECODE, index).url, request.method, request.path,
                      authorization(request), body)


def register(app: web.Application, router_of: Callable[[web.Request], object],
             router_view: Callable[[object], dict]) -> None:
    """Add the routes; `router_of` finds the running router, `router_view` is its `/server_info` body."""

    async def passed(request: web.Request) -> web.Response:
        status, content_type, body = await _from_a_decode(router_of(request), request)
        return web.Response(body=body, status=status, headers={"Content-Type": content_type})

    async def get_server_info(request: web.Request) -> web.Response:
        router = router_of(request)
        status, content_type, body = await _from_a_decode(router, request)
        try:
            info = msgspec.json.decode(body) if status == 200 else None
        except msgspec.DecodeError:
            info = None
        if not isinstance(info, dict):
            return web.Response(body=body, status=status, headers={"Content-Type": content_type})
        return web.json_response({**info, "router": router_view(router)}, dumps=lambda v: msgspec.json.encode(v).decode())

    for path in GET_PATHS:
        app.router.add_get(path, passed)
    for path in POST_PATHS:
        app.router.add_post(path, passed)
    app.router.add_get("/get_server_info", get_server_info)
