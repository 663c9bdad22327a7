"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the middleware that
turns every failure of a handler into one (never a bare 500 page, never a dead server)."""

from __future__ import annotations

import msgspec
import structlog
from aiohttp import web

from disagg.dp.protocol import InconsistentUtilityResults, UtilityFailed, WorkerUnavailable
from disagg.drain import Drain
from disagg.types import EngineSleeping, InvalidRequest
from disagg.wire.errors import DRAINING_CODE, SHUTDOWN_CODE, HttpError, http_exception_error

log = structlog.get_logger("disagg.api")


class ApiError(HttpError):
    """An error answered to the client with `status` and an OpenAI-shaped body."""

    def body(self) -> dict:
        """The JSON body: `{"error": {...}}`."""
        return self.error()


class BadRequest(ApiError):
    """400: the request cannot be served as sent; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(400, message, param=param)


class ModelNotFound(ApiError):
    """404: the request names a model this server does not serve."""

    def __init__(self, model: str):
        super().__init__(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


class Unauthorized(ApiError):
    """401: missing or wrong API key."""

    def __init__(self) -> None:
        super().__init__(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")


def draining_error(drain: Drain) -> ApiError:
    """503 for a new generate request, and for `/health`, while the server drains."""
    return ApiError(503, drain.refusal_message(), code=DRAINING_CODE)


def shutdown_error(drain: Drain) -> ApiError:
    """503 (or the stream's error event) for a request the drain aborted."""
    return ApiError(503, drain.abort_message(), code=SHUTDOWN_CODE)


class UnauthorizedAdmin(ApiError):
    """401: an admin route without the admin key."""

    def __init__(self) -> None:
        super().__init__(401, "Invalid or missing admin key: send 'Authorization: Bearer <admin key>'",
                         code="invalid_admin_key")


class AdminDisabled(ApiError):
    """403: an admin route on a server with an API key but no admin key (an API key never grants admin)."""

    def __init__(self, path: str) -> None:
        super().__init__(403, f"{path} is an admin route and this server has an API key but no admin key: "
                              "start it with --admin-key (or DISAGG_ADMIN_KEY) to use it", code="admin_disabled")


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response carrying `err`."""
    return web.Response(body=msgspec.json.encode(err.body()), status=err.status,
                        content_type="application/json", headers=headers)


def engine_error(message: str, status: int, param: str | None) -> ApiError:
    """An ApiError for a request the engine failed (`OutputMsg.error*`); unknown statuses become 500."""
    if status not in (400, 404, 413, 503):
        status = 500
    return ApiError(status, message, param=param)


def to_api_error(exc: BaseException) -> ApiError:
    """Map any exception a handler lets out to the ApiError the client sees."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return BadRequest(exc.message, exc.param)
    if isinstance(exc, (WorkerUnavailable, EngineSleeping)):
        return ApiError(503, str(exc))
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError too
        return ApiError(503, f"the engine did not answer in time{': ' + str(exc) if str(exc) else ''}")
    if isinstance(exc, InconsistentUtilityResults):
        return ApiError(500, str(exc), error_type="InconsistentUtilityResults")
    if isinstance(exc, UtilityFailed):
        return ApiError(500, str(exc), error_type="UtilityFailed")
    log.error("internal error", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


@web.middleware
async def errors_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as OpenAI-shaped JSON with the right status."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        keep = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "www-authenticate")}
        return error_response(http_exception_error(ApiError, exc.status, exc.text or exc.reason, request.method, request.path), keep)
    except ConnectionResetError:  # the client left; there is nobody to answer
        raise
    except Exception as exc:  # noqa: BLE001 - the boundary: one request's failure never kills the server
        err = to_api_error(exc)
        log.info("request failed", status=err.status, error=err.message, param=err.param)
        return error_response(err)
