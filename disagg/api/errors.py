"""The API's OpenAI-shaped errors (`{"error": {"message", "type", "param", "code"}}`), how every
exception a handler lets out maps to one, and the middleware that answers them (disagg.http_edge):
never a bare 500 page, never a dead server."""

from __future__ import annotations

import structlog

from disagg.api.admission import RETRY_AFTER_S, Overload
from disagg.dp.faults import ENGINE_STATUSES
from disagg.dp.protocol import InconsistentUtilityResults, UtilityFailed, WorkerUnavailable
from disagg.drain import Drain
from disagg.http_edge import BadRequest, Edge, HttpError, error_middleware, http_error_of
from disagg.types import EngineSleeping, ErrorCode, InvalidRequest

log = structlog.get_logger("disagg.api")


class ModelNotFound(HttpError):
    """404: the request names a model this server does not serve."""

    def __init__(self, model: str):
        super().__init__(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


class Unauthorized(HttpError):
    """401: missing or wrong API key."""

    def __init__(self) -> None:
        super().__init__(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key")


def draining_error(drain: Drain) -> HttpError:
    """503 for a new generate request, and for `/health`, while the server drains."""
    return HttpError(503, drain.refusal_message(), code=ErrorCode.DRAINING)


def shutdown_error(drain: Drain) -> HttpError:
    """503 (or the stream's error event) for a request the drain aborted."""
    return HttpError(503, drain.abort_message(), code=ErrorCode.SHUTDOWN)


def overloaded_error(overload: Overload) -> HttpError:
    """429 with Retry-After for a new generate request the overloaded server refuses at once."""
    return HttpError(429, overload.message, code=overload.code, headers={"Retry-After": str(RETRY_AFTER_S)})


class UnauthorizedAdmin(HttpError):
    """401: an admin route without the admin key."""

    def __init__(self) -> None:
        super().__init__(401, "Invalid or missing admin key: send 'Authorization: Bearer <admin key>'",
                         code="invalid_admin_key")


class AdminDisabled(HttpError):
    """403: an admin route on a server with an API key but no admin key (an API key never grants admin)."""

    def __init__(self, path: str) -> None:
        super().__init__(403, f"{path} is an admin route and this server has an API key but no admin key: "
                              "start it with --admin-key (or DISAGG_ADMIN_KEY) to use it", code="admin_disabled")


def engine_error(message: str, status: int, param: str | None, code: ErrorCode | None = None) -> HttpError:
    """An HttpError for a request the engine failed (`OutputMsg.error*`); statuses other than
    ENGINE_STATUSES become 500 (a role's own 499 and 504 included: docs/faults.md)."""
    if status not in ENGINE_STATUSES:  # 429 only from a fail_requests fault
        status = 500
    return HttpError(status, message, param=param, code=code)


def to_api_error(exc: BaseException) -> HttpError:
    """Map any exception a handler lets out to the HttpError the client sees."""
    if isinstance(exc, InvalidRequest):
        return BadRequest(exc.message, exc.param, code=exc.code)
    if isinstance(exc, (WorkerUnavailable, EngineSleeping)):
        return HttpError(503, str(exc))
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError too
        return HttpError(503, f"the engine did not answer in time{': ' + str(exc) if str(exc) else ''}")
    if isinstance(exc, InconsistentUtilityResults):
        return HttpError(500, str(exc), error_type="InconsistentUtilityResults")
    if isinstance(exc, UtilityFailed):
        return HttpError(500, str(exc), error_type="UtilityFailed")
    return http_error_of(exc, log)


def _failed(exc: Exception) -> HttpError:
    err = to_api_error(exc)
    log.info("request failed", status=err.status, error=err.message, param=err.param)
    return err


API_EDGE = Edge(error_of=_failed)
errors_middleware = error_middleware(API_EDGE)  # every error leaves as OpenAI-shaped JSON with the right status
