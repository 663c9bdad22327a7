"""The tcp backend's connection handshake; with a cluster secret, a challenge the peer must answer.

    connecting side                                  listening side
    HELLO(name)                                ->
                                               <-    ACK                            no secret here: done
                                               <-    CHALLENGE(32 random bytes)     cluster secret held here
    AUTH(proof token of disagg/wire/auth.py: bound to
         the nonce, our name, the listener's host:port)  ->
                                               <-    ACK, or ERROR(reason) and the connection closes

Until the handshake is done both sides read a frame's fixed header first, and its tag only when it
is the expected handshake frame, without segments or payload and with at most HANDSHAKE_MAX_TAG_BYTES
of tag. Any other frame is answered with ERROR and the connection closes with nothing beyond its
header read: declared sizes allocate nothing, and no byte from an unauthenticated peer reaches the
registered region. The listener accepts each nonce's answer once (its NonceTable) and only from the
peer that said HELLO; each side bounds the whole handshake by one deadline.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from disagg.wire.auth import KV_TCP, NONCE_BYTES, Binding, NonceTable, ProofRefused, answer, check_proof
from kvtransfer.base import AuthenticationFailed
from kvtransfer.tcp.wire import FrameHead, FrameKind, Header, ProtocolError, read_header, recv_exact, send_frame

HANDSHAKE_MAX_TAG_BYTES = 2048  # a peer name or a proof token
NO_ANSWER = KV_TCP.missing


class HandshakeRefused(ProtocolError):
    """The listener refused a connecting peer; `reason` was sent to it in an ERROR frame."""

    def __init__(self, reason: str, peer: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.peer = peer


@dataclass(frozen=True)
class Gate:
    """What a listener checks connecting peers against: its secret (None: any peer that says HELLO),
    its own address as peers dial it, and the nonces it issued."""

    cluster_secret: str | None
    target: str
    nonces: NonceTable


def _too_large(header: Header) -> str:
    """'' when `header` is a handshake-sized frame, else why it is not."""
    if header.num_segments == 0 and header.payload_bytes == 0 and header.tag_bytes <= HANDSHAKE_MAX_TAG_BYTES:
        return ""
    return (f"{header.kind.name} frame too large for the handshake: {header.num_segments} segments, "
            f"{header.tag_bytes} tag bytes, {header.payload_bytes} payload bytes "
            f"(at most 0, {HANDSHAKE_MAX_TAG_BYTES}, 0)")


def _read_small(sock: socket.socket, header: Header, deadline: float) -> FrameHead:
    return FrameHead(header.kind, header.transfer_id, tag=bytes(recv_exact(sock, header.tag_bytes, deadline)))


def greet(sock: socket.socket, agent_name: str, cluster_secret: str | None, who: str, target: str,
          deadline: float) -> None:
    """The connecting side: introduce ourselves as `agent_name` and answer a challenge if one comes,
    bound to `target` (the listener's host:port as we dialed it).

    `who` names the listener in errors ("peer 'x' at host:port"). AuthenticationFailed when it refuses
    our answer or challenges us without a secret here; ProtocolError/OSError when it speaks garbage or
    goes away; TimeoutError past `deadline` (time.monotonic)."""
    send_frame(sock, FrameHead(FrameKind.HELLO, tag=agent_name.encode()))
    reply = _reply(sock, who, deadline)
    if reply.kind is FrameKind.CHALLENGE:
        if cluster_secret is None:
            raise AuthenticationFailed(f"{who} requires a cluster secret and this endpoint has none (set --cluster-secret)")
        binding = Binding(reply.tag, os.urandom(NONCE_BYTES), agent_name, target)
        send_frame(sock, FrameHead(FrameKind.AUTH, tag=answer(cluster_secret, KV_TCP, binding).encode()))
        reply = _reply(sock, who, deadline)
    if reply.kind is FrameKind.ERROR:
        raise AuthenticationFailed(f"{who} refused the connection: {reply.tag.decode(errors='replace')}")
    if reply.kind is not FrameKind.ACK:
        raise ProtocolError(f"{who} answered HELLO with {reply.kind.name}")


def _reply(sock: socket.socket, who: str, deadline: float) -> FrameHead:
    header = read_header(sock, deadline)
    if refusal := _too_large(header):
        raise ProtocolError(f"{who} sent a {refusal}")
    return _read_small(sock, header, deadline)


def admit(conn: socket.socket, gate: Gate, deadline: float) -> str:
    """The listening side: the connecting peer's name once it passed the handshake, else HandshakeRefused
    (after telling the peer why) or ProtocolError/OSError (TimeoutError past `deadline`)."""
    secret = gate.cluster_secret
    hello = _expect(conn, FrameKind.HELLO, deadline, NO_ANSWER if secret is not None else "")
    peer = hello.tag.decode()
    if secret is not None:
        nonce = gate.nonces.issue(os.urandom(NONCE_BYTES), time.monotonic())
        send_frame(conn, FrameHead(FrameKind.CHALLENGE, tag=nonce))
        auth = _expect(conn, FrameKind.AUTH, deadline, NO_ANSWER, peer)
        try:
            check_proof(secret, KV_TCP, auth.tag.decode(errors="replace"), targets=(gate.target,), nonces=gate.nonces,
                        now=time.monotonic(), client=peer)
        except ProofRefused as exc:
            _refuse(conn, auth.transfer_id, exc.reason, peer)
    send_frame(conn, FrameHead(FrameKind.ACK))
    conn.settimeout(None)
    return peer


def _expect(conn: socket.socket, kind: FrameKind, deadline: float, wrong_kind: str, peer: str = "") -> FrameHead:
    """The next frame, when it is a small `kind` frame; else refused with nothing past its header read
    (`wrong_kind` names the refusal of another kind; '' says which kind was expected)."""
    header = read_header(conn, deadline)
    if header.kind is not kind:
        _refuse(conn, header.transfer_id, wrong_kind or f"expected {kind.name}, got {header.kind.name}", peer)
    if refusal := _too_large(header):
        _refuse(conn, header.transfer_id, refusal, peer)
    return _read_small(conn, header, deadline)


def _refuse(conn: socket.socket, transfer_id: int, reason: str, peer: str = "") -> None:
    send_frame(conn, FrameHead(FrameKind.ERROR, transfer_id, tag=reason.encode()))
    raise HandshakeRefused(reason, peer)
