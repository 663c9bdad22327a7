"""Typed router errors (disagg.http_edge's HttpError); each knows the HTTP status and the body the client gets.

Bodies are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`), except a server's
own error answer, which is passed through unchanged when it is JSON.
"""

from __future__ import annotations

import msgspec

from disagg.http_edge import HttpError
from disagg.types import ErrorCode


class NoHealthyServer(HttpError):
    """503: every server of a role is unhealthy, so no pair can be formed."""

    def __init__(self, role: str):
        super().__init__(503, f"no healthy {role} server", code="no_healthy_server")
        self.role = role


class RouterDraining(HttpError):
    """503: the router is shutting down and takes no new requests (its /health says the same)."""

    def __init__(self, message: str):
        super().__init__(503, message, code=ErrorCode.DRAINING)


class RequestShutDown(HttpError):
    """503 (or the stream's error event): the router shut down before this request finished."""

    def __init__(self, message: str):
        super().__init__(503, message, code=ErrorCode.SHUTDOWN)


class ServerUnreachable(HttpError):
    """502: a server could not be reached, or dropped the connection."""

    def __init__(self, role: str, url: str, reason: str):
        super().__init__(502, f"{role} server {url} unreachable: {reason}", code="upstream_unreachable")
        self.role = role
        self.url = url


class ServerTimeout(HttpError):
    """504: a server did not answer within the request timeout."""

    def __init__(self, role: str, url: str, timeout_s: float):
        super().__init__(504, f"{role} server {url} did not answer within {timeout_s:g} s", code="upstream_timeout")
        self.role = role
        self.url = url


class DpRankMismatch(HttpError):
    """500 (external-DP-routing test mode): the decode served the request on another DP rank."""

    def __init__(self, sent: int, reported: object):
        super().__init__(
            500, f"DP rank mismatch: sent routed_dp_rank={sent} to decode, it reported {reported}",
            code="dp_rank_mismatch",
        )


class ServerError(HttpError):
    """A server answered with a non-2xx status: its status and body go to the client as they are,
    with its Retry-After (a 429's).

    A JSON body is passed through unchanged; any other body is wrapped into an OpenAI-shaped error
    whose message names the server.
    """

    def __init__(self, role: str, url: str, status: int, raw: bytes, content_type: str,
                 retry_after: str | None = None):
        self.role = role
        self.url = url
        self.raw = raw
        self.raw_content_type = content_type
        text = raw.decode("utf-8", "replace").strip() or f"HTTP {status}"
        super().__init__(status, f"{role} server {url} answered {status}: {text}",
                         headers=None if retry_after is None else {"Retry-After": retry_after})

    def body(self) -> bytes:
        """The server's own JSON error body, or an OpenAI-shaped one wrapping its text."""
        if self._raw_is_json():
            return self.raw
        return super().body()

    def _raw_is_json(self) -> bool:
        if "json" not in self.raw_content_type:
            return False
        try:
            msgspec.json.decode(self.raw)
        except msgspec.DecodeError:
            return False
        return True


class ServerDraining(ServerError):
    """A server refused a new request with 503 because it is shutting down (`code` draining) or
    switching roles (role_switching, stale_role_epoch); the router marks it unhealthy and sends the
    request to another server. `index` is the server's place in its role."""

    def __init__(self, role: str, index: int, url: str, raw: bytes, content_type: str,
                 code: ErrorCode = ErrorCode.DRAINING):
        super().__init__(role, url, 503, raw, content_type)
        self.index = index
        self.code = code


def retryable(exc: HttpError, num_servers_in_role: int) -> bool:
    """A failure that says nothing against another pair: a server unreachable, or one answering 503
    (a dead or restarting DP rank, a full KV cache, a lost prefill), or 429 (overloaded) when its
    role has another server (`num_servers_in_role`); the same server again would refuse it again."""
    if isinstance(exc, ServerUnreachable):
        return True
    if not isinstance(exc, ServerError):
        return False
    return exc.status == 503 or (exc.status == 429 and num_servers_in_role > 1)


def sse_error_event(err: HttpError) -> bytes:
    """One `data:` event holding the error body (compact JSON, so one line), then `data: [DONE]`."""
    try:
        payload = msgspec.json.encode(msgspec.json.decode(err.body()))
    except msgspec.DecodeError:
        payload = HttpError.body(err)
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"
