"""Server-sent events: `data: <json>` frames, one error event on failure, `data: [DONE]` at the end."""

from __future__ import annotations

import msgspec
from aiohttp import web

from disagg.http_edge import HttpError


class ClientGone(Exception):
    """The client closed the connection; nothing more can be sent."""


class SSEWriter:
    """Writes one SSE response. Every send raises ClientGone once the client has left."""

    def __init__(self, headers: dict[str, str]):
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
            **headers,
        })

    async def start(self, request: web.Request) -> None:
        """Send the status line and headers (200, text/event-stream)."""
        try:
            await self.response.prepare(request)
        except ConnectionResetError as exc:
            raise ClientGone() from exc

    async def send(self, payload: object) -> None:
        """One `data:` event holding `payload` as JSON."""
        await self._write(b"data: " + msgspec.json.encode(payload) + b"\n\n")

    async def send_all(self, payloads: list[object]) -> None:
        """One event per payload, in order."""
        for payload in payloads:
            await self.send(payload)

    async def send_error(self, err: HttpError) -> None:
        """The error event (the OpenAI error body); the stream then ends with `[DONE]`."""
        await self.send(err.error())

    async def done(self) -> None:
        """`data: [DONE]` and the end of the response."""
        await self._write(b"data: [DONE]\n\n")
        try:
            await self.response.write_eof()
        except ConnectionResetError as exc:
            raise ClientGone() from exc

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError as exc:
            raise ClientGone() from exc
