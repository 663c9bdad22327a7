"""The tcp backend's connection handshake; with a cluster secret, a challenge the peer must answer.

    connecting side                    listening side
    HELLO(name)                  ->
                                 <-    ACK                            no secret here: done
                                 <-    CHALLENGE(32 random bytes)     cluster secret held here
    AUTH(HMAC-SHA256(secret, nonce)) ->
                                 <-    ACK, or ERROR(reason) and the connection closes

Until the handshake is done the listener reads frame heads only: any other frame is answered with
ERROR and the connection closes without its payload being read, so no byte from an unauthenticated
peer reaches the registered region. Both sides bound the handshake by a deadline.
"""

from __future__ import annotations

import os
import socket

from disagg.wire.auth import challenge_answer, challenge_answer_matches
from kvtransfer.base import AuthenticationFailed
from kvtransfer.tcp.wire import FrameHead, FrameKind, ProtocolError, read_head, send_frame

HANDSHAKE_TIMEOUT_S = 10.0
CHALLENGE_BYTES = 32
NO_ANSWER = "cluster secret required: answer the challenge before any other frame"


class HandshakeRefused(ProtocolError):
    """The listener refused a connecting peer; `reason` was sent to it in an ERROR frame."""

    def __init__(self, reason: str, peer: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.peer = peer


def greet(sock: socket.socket, agent_name: str, cluster_secret: str | None, who: str) -> None:
    """The connecting side: introduce ourselves as `agent_name` and answer a challenge if one comes.

    `who` names the listener in errors ("peer 'x' at host:port"). AuthenticationFailed when it refuses
    our answer or challenges us without a secret here; ProtocolError/OSError when it speaks garbage or
    goes away. Bounded by the socket's timeout, which the caller sets."""
    send_frame(sock, FrameHead(FrameKind.HELLO, tag=agent_name.encode()))
    reply = read_head(sock)
    if reply.kind is FrameKind.CHALLENGE:
        if cluster_secret is None:
            raise AuthenticationFailed(f"{who} requires a cluster secret and this endpoint has none (set --cluster-secret)")
        send_frame(sock, FrameHead(FrameKind.AUTH, tag=challenge_answer(cluster_secret, reply.tag)))
        reply = read_head(sock)
    if reply.kind is FrameKind.ERROR:
        raise AuthenticationFailed(f"{who} refused the connection: {reply.tag.decode(errors='replace')}")
    if reply.kind is not FrameKind.ACK:
        raise ProtocolError(f"{who} answered HELLO with {reply.kind.name}")


def admit(conn: socket.socket, cluster_secret: str | None) -> str:
    """The listening side: the connecting peer's name once it passed the handshake, else HandshakeRefused
    (after telling the peer why) or ProtocolError/OSError. Bounded by HANDSHAKE_TIMEOUT_S."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    hello = read_head(conn)
    if hello.kind is not FrameKind.HELLO:
        _refuse(conn, hello, NO_ANSWER if cluster_secret is not None else f"expected HELLO, got {hello.kind.name}")
    peer = hello.tag.decode()
    if cluster_secret is not None:
        nonce = os.urandom(CHALLENGE_BYTES)
        send_frame(conn, FrameHead(FrameKind.CHALLENGE, tag=nonce))
        answer = read_head(conn)
        if answer.kind is not FrameKind.AUTH:
            _refuse(conn, answer, NO_ANSWER, peer)
        if not challenge_answer_matches(cluster_secret, nonce, answer.tag):
            _refuse(conn, answer, "cluster secret mismatch", peer)
    send_frame(conn, FrameHead(FrameKind.ACK))
    conn.settimeout(None)
    return peer


def _refuse(conn: socket.socket, head: FrameHead, reason: str, peer: str = "") -> None:
    send_frame(conn, FrameHead(FrameKind.ERROR, head.transfer_id, tag=reason.encode()))
    raise HandshakeRefused(reason, peer)
