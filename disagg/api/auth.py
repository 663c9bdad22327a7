"""Bearer keys of the front door: the API key on inference and info routes, the admin key on admin routes.

Rules (docs/security.md):
- the probes (`/health`, `/metrics`) are always open;
- admin routes (ADMIN_PATHS): with `admin_key`, only `Authorization: Bearer <admin key>` (401 otherwise);
  with an `api_key` but no admin key, 403: an API key never grants admin rights; with neither, open,
  as upstream servers are for local use;
- every other route: with `api_key`, only `Authorization: Bearer <api key>` (401 otherwise).
Keys are compared in constant time.
"""

from __future__ import annotations

from aiohttp import web

from disagg.api.errors import AdminDisabled, Unauthorized, UnauthorizedAdmin
from disagg.wire.auth import bearer_matches

OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PATHS = frozenset({
    "/abort_request", "/abort_requests", "/reset_prefix_cache", "/flush_cache", "/sleep", "/wake_up", "/faults",
    "/pd_role_switch",
})


def check_access(path: str, authorization: str | None, api_key: str | None, admin_key: str | None) -> None:
    """Raise the HttpError a request for `path` with this Authorization header gets, or return."""
    if path in OPEN_PATHS:
        return
    if path in ADMIN_PATHS:
        if admin_key is not None:
            if not bearer_matches(authorization, admin_key):
                raise UnauthorizedAdmin()
        elif api_key is not None:
            raise AdminDisabled(path)
        return
    if api_key is not None and not bearer_matches(authorization, api_key):
        raise Unauthorized()


def auth_middleware(api_key: str | None, admin_key: str | None):
    """A middleware applying `check_access`, or None when neither key is set (everything open)."""
    if api_key is None and admin_key is None:
        return None

    @web.middleware
    async def check_keys(request: web.Request, handler) -> web.StreamResponse:
        check_access(request.path, request.headers.get("Authorization"), api_key, admin_key)
        return await handler(request)

    return check_keys
