"""The OpenAI-shaped error body every HTTP answer of ours uses: `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from typing import TypeVar

# Why a JSON body that exhausts the decoder's recursion is refused; each HTTP edge puts its own prefix.
JSON_TOO_DEEP = "it is nested too deeply"

TYPE_OF_STATUS = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError", 405: "MethodNotAllowedError",
    413: "RequestTooLargeError", 500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}

# Error codes of the drain (disagg.drain): a 503 with DRAINING_CODE refuses a new request because the
# server is shutting down (a router sends the request to another server); SHUTDOWN_CODE ends a request
# the shutdown aborted.
DRAINING_CODE = "draining"
SHUTDOWN_CODE = "shutdown"


def is_draining_answer(status: int, body: object) -> bool:
    """True for a server's 503 whose JSON error body carries DRAINING_CODE."""
    error = body.get("error") if isinstance(body, dict) else None
    return status == 503 and isinstance(error, dict) and error.get("code") == DRAINING_CODE


def error_type_of(status: int) -> str:
    return TYPE_OF_STATUS.get(status, "APIError")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               error_type: str | None = None) -> dict:
    """The JSON error object for an HTTP `status` (the type defaults from the status)."""
    return {"error": {"message": message, "type": error_type or error_type_of(status), "param": param, "code": code}}


class HttpError(Exception):
    """An error answered with `status` and an OpenAI-shaped body (`error()` is the JSON object)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or error_type_of(status)

    def error(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code, error_type=self.error_type)


def http_exception_error(cls: type[E], status: int, text: str, method: str, path: str) -> E:
    """The `cls` error for an HTTP framework exception (unknown route, wrong method, body too large)."""
    if status == 404:
        return cls(404, f"Not Found: {method} {path}", code="route_not_found")
    if status == 405:
        return cls(405, f"Method Not Allowed: {method} {path}")
    if status == 413:
        return cls(413, f"request body too large: {text}")
    return cls(status, text)


E = TypeVar("E", bound=HttpError)
