"""Length-prefixed frames (4-byte big-endian length, then the payload) over a stream socket."""

from __future__ import annotations

import asyncio
import socket
import struct

HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 1 << 30


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame; raises asyncio.IncompleteReadError at EOF."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return await reader.readexactly(size)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


class FrameSocket:
    """Blocking-side endpoint (the worker): send frames, and read whatever frames have arrived."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buffer = bytearray()

    def send(self, *payloads: bytes) -> None:
        """All payloads in one write (the worker sends a step's outputs together)."""
        self.sock.settimeout(None)
        self.sock.sendall(b"".join(frame(p) for p in payloads))

    def receive(self, timeout_s: float) -> list[bytes]:
        """Frames available within `timeout_s` (0: only what is already here). Raises EOFError on close."""
        self.sock.settimeout(timeout_s if timeout_s > 0 else 0.0)
        try:
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise EOFError("front process closed the connection")
                self._buffer += chunk
                self.sock.settimeout(0.0)  # got data: drain without waiting any longer
        except (BlockingIOError, TimeoutError, socket.timeout):
            pass
        return self._split()

    def _split(self) -> list[bytes]:
        frames = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            assert size <= MAX_FRAME_BYTES, f"frame of {size} bytes"
            if len(self._buffer) < HEADER.size + size:
                break
            frames.append(bytes(self._buffer[HEADER.size : HEADER.size + size]))
            del self._buffer[: HEADER.size + size]
        return frames

    def close(self) -> None:
        self.sock.close()
