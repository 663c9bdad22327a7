"""The tcp backend's frames: a fixed little-endian header, segments, a tag, then raw payload bytes.

    header   kind u8 | pad 3 | num_segments u32 | tag_bytes u32 | transfer_id u64 | payload_bytes u64
    segments num_segments x (offset_bytes u64, size_bytes u64), offsets into the receiver's region
    tag      tag_bytes bytes (notification tag, peer name for HELLO, reason for ERROR, nonce for
             CHALLENGE, HMAC answer for AUTH)
    payload  payload_bytes bytes (WRITE: the blocks, in segment order; DATA: the blocks read)

Conversation: the connecting side sends HELLO(name) once and completes the handshake of tcp/auth.py
(ACK at once, or CHALLENGE / AUTH / ACK when the listener holds a cluster secret), then WRITE / READ /
NOTIF requests; the listening side answers WRITE with ACK (after the bytes landed), READ with DATA, bad
requests with ERROR. During the handshake both sides read the fixed header first (`read_header`) and
take its tag only when the frame is small (tcp/auth.py): a declared size allocates nothing.
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvtransfer.descriptors import Segment, Segments

_HEADER = struct.Struct("<B3xIIQQ")
HEADER_BYTES = _HEADER.size
_SEGMENT = struct.Struct("<QQ")
MAX_SEGMENTS = 1 << 20
MAX_TAG_BYTES = 1 << 16
FEW_SEGMENTS = 16  # a frame with more carries them as arrays (Segments): head slices
_DISCARD_CHUNK_BYTES = 1 << 20


class FrameKind(enum.IntEnum):
    HELLO = 1
    WRITE = 2
    READ = 3
    DATA = 4
    ACK = 5
    ERROR = 6
    NOTIF = 7
    CHALLENGE = 8
    AUTH = 9


class ProtocolError(ConnectionError):
    """The byte stream is not a valid frame sequence; the connection must close."""


@dataclass(frozen=True)
class FrameHead:
    """Everything of a frame but its payload, which the reader then takes from the socket."""

    kind: FrameKind
    transfer_id: int = 0
    segments: tuple[Segment, ...] | Segments = ()
    tag: bytes = b""
    payload_bytes: int = 0


class Header(NamedTuple):
    """A frame's fixed header: what it declares, nothing of it read yet."""

    kind: FrameKind
    num_segments: int
    tag_bytes: int
    transfer_id: int
    payload_bytes: int


def encode_head(head: FrameHead) -> bytes:
    parts = [_HEADER.pack(head.kind, len(head.segments), len(head.tag), head.transfer_id, head.payload_bytes)]
    if isinstance(head.segments, Segments):
        parts.append(np.stack([head.segments.offsets, head.segments.sizes], axis=1).astype("<u8").tobytes())
    else:
        parts += [_SEGMENT.pack(*segment) for segment in head.segments]
    parts.append(head.tag)
    return b"".join(parts)


def read_header(sock: socket.socket, deadline: float | None = None) -> Header:
    """Read a frame's fixed header only (HEADER_BYTES); ConnectionError on EOF, ProtocolError on an
    unknown kind, TimeoutError past `deadline` (time.monotonic)."""
    kind, *rest = _HEADER.unpack(recv_exact(sock, HEADER_BYTES, deadline))
    if kind not in FrameKind.__members__.values():
        raise ProtocolError(f"unknown frame kind {kind}")
    return Header(FrameKind(kind), *rest)


def read_head(sock: socket.socket) -> FrameHead:
    """Read one frame head; ConnectionError on EOF, ProtocolError on garbage."""
    kind, num_segments, tag_bytes, transfer_id, payload_bytes = read_header(sock)
    if num_segments > MAX_SEGMENTS or tag_bytes > MAX_TAG_BYTES:
        raise ProtocolError(f"frame too large: {num_segments} segments, {tag_bytes} tag bytes")
    raw = recv_exact(sock, num_segments * _SEGMENT.size + tag_bytes)
    segments: tuple[Segment, ...] | Segments
    if num_segments > FEW_SEGMENTS:
        pairs = np.frombuffer(raw, dtype="<u8", count=2 * num_segments).reshape(-1, 2)
        if (pairs >= 1 << 62).any():
            raise ProtocolError("a segment's offset or size is out of range")
        segments = Segments(pairs[:, 0], pairs[:, 1])
    else:
        segments = tuple(Segment(*_SEGMENT.unpack_from(raw, i * _SEGMENT.size)) for i in range(num_segments))
    return FrameHead(kind, transfer_id, segments, bytes(raw[num_segments * _SEGMENT.size:]), payload_bytes)


def recv_exact(sock: socket.socket, num_bytes: int, deadline: float | None = None) -> bytearray:
    buffer = bytearray(num_bytes)
    recv_into_exact(sock, memoryview(buffer), deadline)
    return buffer


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the socket (straight into the caller's memory, no staging copy). With a
    `deadline` (time.monotonic), TimeoutError once it passes, however slowly the bytes trickle in."""
    received = 0
    while received < len(view):
        if deadline is not None:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(remaining_s)
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("connection closed by the other side")
        received += count


def discard(sock: socket.socket, num_bytes: int) -> None:
    """Read and drop `num_bytes` (the payload of a frame we refuse)."""
    scratch = memoryview(bytearray(min(num_bytes, _DISCARD_CHUNK_BYTES)))
    while num_bytes > 0:
        chunk = scratch[: min(num_bytes, len(scratch))]
        recv_into_exact(sock, chunk)
        num_bytes -= len(chunk)


def send_frame(sock: socket.socket, head: FrameHead, payload: list[memoryview] | tuple = ()) -> None:
    """Send a head and its payload views. Small payloads ride in the head's syscall."""
    data = encode_head(head)
    if payload and sum(len(view) for view in payload) <= 64 * 1024:
        sock.sendall(data + b"".join(payload))
        return
    sock.sendall(data)
    for view in payload:
        sock.sendall(view)
