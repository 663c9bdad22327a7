"""The HTTP edge of our three servers (the API, the router, the bootstrap registry): the error body
every answer uses, HttpError and BadRequest, the JSON body decoder and the error middleware.

A request body is limited in size by aiohttp (`client_max_size`; the middleware answers 413), in
nesting depth by the decoder's recursion, and must be UTF-8; a body past a limit is a 400, never a
500. The servers differ only in values: the words of a refused body (`decode_json`'s arguments) and
how a failure is answered (an `Edge`: the registry's error body is `{"error": message}` and keeps
aiohttp's own texts, as SGLang's does).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from disagg.types import ErrorCode

T = TypeVar("T")
# Why a JSON body that exhausts the decoder's recursion is refused; each server puts its own words before it.
JSON_TOO_DEEP = "it is nested too deeply"
NOT_UTF8 = "it is not valid UTF-8"
_PATH_RE = re.compile(r"at `\$\.([A-Za-z_][\w.]*)")
# Headers of aiohttp's own errors that the answer keeps (405's Allow, a 401's challenge).
KEPT_HEADERS = ("allow", "www-authenticate")

TYPE_OF_STATUS = {
    400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError", 405: "MethodNotAllowedError",
    413: "RequestTooLargeError", 429: "RateLimitError", 500: "InternalServerError", 502: "BadGatewayError", 503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}



# A server's 503 with one of these: it takes no new request now (it shuts down, or switches roles);
# a router takes it out of rotation and sends the request to another server.
OUT_OF_ROTATION = (ErrorCode.DRAINING, ErrorCode.ROLE_SWITCHING, ErrorCode.STALE_ROLE_EPOCH)


def refusal_code(status: int, body: object) -> ErrorCode | None:
    """The OUT_OF_ROTATION code of a server's 503 JSON error body, else None."""
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return next((c for c in OUT_OF_ROTATION if code == c.value), None) if status == 503 else None


def error_type_of(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return TYPE_OF_STATUS.get(status, "APIError")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               error_type: str | None = None) -> dict:
    """The JSON error object for an HTTP `status` (the type defaults from the status)."""
    return {"error": {"message": message, "type": error_type or error_type_of(status), "param": param, "code": code}}


class HttpError(Exception):
    """An error answered with `status` and an OpenAI-shaped body (`error()` is the JSON object), and
    `headers` (a 429's Retry-After)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or error_type_of(status)

    def error(self) -> dict:
        """The JSON object: `{"error": {"message", "type", "param", "code"}}`."""
        return error_body(self.status, self.message, param=self.param, code=self.code, error_type=self.error_type)

    def body(self) -> bytes:
        """The answer's JSON bytes: `error()` encoded (an error relaying a server's own answer overrides it)."""
        return msgspec.json.encode(self.error())


class BadRequest(HttpError):
    """400: the request cannot be served as sent; `param` names the field."""

    def __init__(self, message: str, param: str | None = None, code: ErrorCode | None = None):
        super().__init__(400, message, param=param, code=code)


def not_utf8(raw: bytes | str) -> bool:
    """Whether a body that failed to decode is not UTF-8 at all (asked only after it failed)."""
    if isinstance(raw, str):
        return False
    try:
        bytes(raw).decode()
    except UnicodeDecodeError:
        return True
    return False


def decode_json(raw: bytes, kind: type[T] = Any, *, malformed: str, invalid: str = "invalid request body",
                strict: bool = True) -> T:
    """`raw` decoded as `kind`, else BadRequest: `<malformed>: <why>` for a body that is not JSON, not
    UTF-8 or nested too deeply; `<invalid>: <why>` for JSON of the wrong shape, `param` naming the field.
    `strict=False` takes numbers and booleans written as strings."""
    try:
        return msgspec.json.decode(raw, type=kind, strict=strict)
    except msgspec.ValidationError as exc:  # a DecodeError subclass: catch it first
        match = _PATH_RE.search(str(exc))
        raise BadRequest(f"{invalid}: {exc}", match.group(1) if match else None) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{malformed}: {NOT_UTF8 if not_utf8(raw) else exc}") from None
    except UnicodeDecodeError:  # msgspec before 0.23 raised this; later ones a DecodeError in their words
        raise BadRequest(f"{malformed}: {NOT_UTF8}") from None
    except RecursionError:
        raise BadRequest(f"{malformed}: {JSON_TOO_DEEP}") from None


def http_exception_error(status: int, text: str, method: str, path: str) -> HttpError:
    """The error for an HTTP framework exception (unknown route, wrong method, body too large)."""
    if status == 404:
        return HttpError(404, f"Not Found: {method} {path}", code="route_not_found")
    if status == 405:
        return HttpError(405, f"Method Not Allowed: {method} {path}")
    if status == 413:
        return HttpError(413, f"request body too large: {text}")
    return HttpError(status, text)


def http_error_of(exc: Exception, log) -> HttpError:
    """The answer to an exception a handler let out: an HttpError itself, anything else a 500
    `internal error` (logged on `log` with its traceback)."""
    if isinstance(exc, HttpError):
        return exc
    log.error("internal error", exc_info=exc)
    return HttpError(500, f"internal error: {type(exc).__name__}: {exc}")


def _own_body(err: HttpError) -> bytes:
    return err.body()


@dataclass(frozen=True)
class Edge:
    """How one server answers a request that failed."""

    # The answer to an exception a handler let out; None leaves it to aiohttp (a plain 500).
    error_of: Callable[[Exception], HttpError | None]
    # The error's JSON bytes (the registry's: `{"error": message}`).
    render: Callable[[HttpError], bytes] = _own_body
    # True: aiohttp's own texts for its errors (unknown path, wrong method, body too large).
    aiohttp_texts: bool = False

    def response(self, err: HttpError, headers: dict[str, str] | None = None) -> web.Response:
        """The JSON answer carrying `err`."""
        return web.Response(body=self.render(err), status=err.status, content_type="application/json",
                            headers=headers)

    def framework_error(self, exc: web.HTTPException, request: web.Request) -> HttpError:
        """The error for one of aiohttp's own exceptions."""
        text = exc.text or exc.reason
        if self.aiohttp_texts:
            return HttpError(exc.status, text)
        return http_exception_error(exc.status, text, request.method, request.path)


def error_middleware(edge: Edge):
    """The middleware that answers every failure as JSON with its status, as `edge` says."""

    @web.middleware
    async def errors_as_json(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:  # unknown path, wrong method, body too large
            if exc.status < 400:
                raise
            keep = {k: v for k, v in exc.headers.items() if k.lower() in KEPT_HEADERS}
            return edge.response(edge.framework_error(exc, request), keep)
        except ConnectionResetError:  # the client left; there is nobody to answer
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary: one request's failure never kills the server
            err = edge.error_of(exc)
            if err is None:
                raise
            return edge.response(err, err.headers or None)

    return errors_as_json


def invocation_path(raw: bytes) -> str:
    """The route an `/invocations` body (SageMaker's, as vLLM serves it) stands for: a chat body (it
    has `messages`) `/v1/chat/completions`, a completions body (`prompt`) `/v1/completions`; else a 400."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise BadRequest("malformed JSON body") from None
    if isinstance(body, dict) and "messages" in body:
        return "/v1/chat/completions"
    if isinstance(body, dict) and "prompt" in body:
        return "/v1/completions"
    raise BadRequest("an /invocations body is a chat completion (with messages) or a completion (with prompt)")
