"""Length-prefixed frames (4-byte big-endian length, then the payload) over a stream socket."""

from __future__ import annotations

import asyncio
import struct

HEADER = struct.Struct("!I")


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One frame; raises asyncio.IncompleteReadError at EOF."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    return await reader.readexactly(size)


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload
