"""The tcp backend's inbound side: accept peers and serve their frames against our registered region.

One thread accepts; one thread per connection reads frames, lands WRITE payloads straight into the
region (recv_into over a view of the caller's memory), answers READs from it and queues notifications.
A connection serves frames only after the handshake of tcp/auth.py (the cluster secret's challenge).
Before it, the listener is bounded: at most `max_pending_connections` connections (and so threads)
are in the handshake at once, more are closed at once, and each gets `handshake_timeout_s` in all.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence

import structlog

from disagg.pd_config import TcpListenerConfig
from disagg.wire.auth import NonceTable, format_address
from kvtransfer.base import Notification
from kvtransfer.descriptors import Segment, Segments, segment_in_bounds
from kvtransfer.tcp.auth import Gate, HandshakeRefused, admit
from kvtransfer.tcp.wire import FrameHead, FrameKind, ProtocolError, discard, read_head, recv_into_exact, send_frame

JOIN_TIMEOUT_S = 2.0
log = structlog.get_logger("kvtransfer.tcp")


def shutdown_quietly(sock: socket.socket) -> None:
    """Wake any thread blocked on `sock` and close it; errors of an already-dead socket are moot."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class InboundServer:
    def __init__(self, host: str, on_notification: Callable[[Notification], None],
                 cluster_secret: str | None = None, limits: TcpListenerConfig = TcpListenerConfig()) -> None:
        self._listener = socket.create_server((host, 0))
        self.host: str = self._listener.getsockname()[0]
        self.port: int = self._listener.getsockname()[1]
        # cluster_secret None: any peer that says HELLO is served
        self._gate = Gate(cluster_secret, format_address(self.host, self.port), NonceTable(limits.handshake_timeout_s))
        self._limits = limits
        self._on_notification = on_notification
        self._lock = threading.Lock()
        self._region: memoryview | None = None
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._pending: set[socket.socket] = set()  # accepted, still in the handshake
        self._names: dict[socket.socket, str] = {}  # admitted connections: the peer that spoke HELLO
        self.num_refused_connections = 0  # closed at once: the handshake was full
        self._closing = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"kv-tcp-accept-{self.port}", daemon=True)
        self._accept_thread.start()

    def attach_region(self, region: memoryview) -> None:
        """Serve frames against `region` (the registered cache, as bytes)."""
        with self._lock:
            self._region = region

    def detach_region(self) -> None:
        """Close every inbound connection and wait for its thread, so no frame touches the region after."""
        with self._lock:
            self._region = None
            connections = list(self._connections.items())
        self._stop_connections(connections)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._region = None
            connections = list(self._connections.items())
        shutdown_quietly(self._listener)
        self._accept_thread.join(JOIN_TIMEOUT_S)
        self._stop_connections(connections)

    def cut_peer(self, peer: str) -> int:
        """Close every connection of `peer` and wait for its thread: once this returns, nothing that
        peer sent can land in the region any more. Returns how many connections were cut."""
        with self._lock:
            connections = [(c, t) for c, t in self._connections.items() if self._names.get(c) == peer]
        self._stop_connections(connections)
        return len(connections)

    def _stop_connections(self, connections: list[tuple[socket.socket, threading.Thread]]) -> None:
        for conn, _ in connections:
            shutdown_quietly(conn)
        for _, thread in connections:
            if thread is not threading.current_thread():
                thread.join(JOIN_TIMEOUT_S)

    @property
    def num_pending(self) -> int:
        """Connections in the handshake now (each holds one thread)."""
        with self._lock:
            return len(self._pending)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, address = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                if self._closing:
                    shutdown_quietly(conn)
                    return
                thread = None
                if len(self._pending) < self._limits.max_pending_connections:
                    thread = threading.Thread(target=self._serve, args=(conn,), name=f"kv-tcp-serve-{self.port}",
                                              daemon=True)
                    self._pending.add(conn)
                    self._connections[conn] = thread
                else:
                    self.num_refused_connections += 1
            if thread is None:
                shutdown_quietly(conn)
                log.warning("kv connection refused", port=self.port, peer=format_address(*address[:2]),
                            reason=f"{self._limits.max_pending_connections} connections are already in the handshake")
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            peer = self._admit(conn)
            with self._lock:
                self._pending.discard(conn)
                if peer is not None:
                    self._names[conn] = peer
            while peer is not None:
                self._serve_frame(conn, peer, read_head(conn))
        except (OSError, UnicodeDecodeError):
            pass  # the peer went away or spoke garbage: drop the connection, the peer sees it closed
        finally:
            with self._lock:
                self._connections.pop(conn, None)
                self._pending.discard(conn)
                self._names.pop(conn, None)
            shutdown_quietly(conn)

    def _admit(self, conn: socket.socket) -> str | None:
        """The peer's name once it passed the handshake; None (logged) when it did not."""
        try:
            return admit(conn, self._gate, time.monotonic() + self._limits.handshake_timeout_s)
        except HandshakeRefused as exc:
            log.warning("kv connection refused", port=self.port, peer=exc.peer, reason=exc.reason)
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("kv connection dropped during the handshake", port=self.port,
                        error=str(exc) or type(exc).__name__)
        return None

    def _serve_frame(self, conn: socket.socket, peer: str, head: FrameHead) -> None:
        if head.kind is FrameKind.NOTIF:
            self._on_notification(Notification(peer, head.tag))
            return
        if head.kind not in (FrameKind.WRITE, FrameKind.READ):
            raise ProtocolError(f"unexpected {head.kind.name} frame from a peer")
        region = self._region
        refusal = _refusal(head, region)
        if refusal:
            discard(conn, head.payload_bytes)
            send_frame(conn, FrameHead(FrameKind.ERROR, head.transfer_id, tag=refusal.encode()))
            return
        assert region is not None
        if head.kind is FrameKind.WRITE:
            if staged(head.segments):  # head slices: received and scattered a bounded run at a time
                for part in head.segments.chunks():
                    staging = bytearray(part.total_bytes)
                    recv_into_exact(conn, memoryview(staging))
                    part.scatter(region, staging)
            else:
                for segment in listed(head.segments):
                    recv_into_exact(conn, region[segment.offset_bytes: segment.offset_bytes + segment.size_bytes])
            if head.tag:
                self._on_notification(Notification(peer, head.tag))
            send_frame(conn, FrameHead(FrameKind.ACK, head.transfer_id))
        else:
            if staged(head.segments):  # head slices: gathered and sent a bounded run at a time
                send_frame(conn, FrameHead(FrameKind.DATA, head.transfer_id, payload_bytes=head.segments.total_bytes))
                for part in head.segments.chunks():
                    conn.sendall(part.gather(region))
            else:
                views = [region[s.offset_bytes: s.offset_bytes + s.size_bytes] for s in listed(head.segments)]
                send_frame(conn, FrameHead(FrameKind.DATA, head.transfer_id, payload_bytes=sum(map(len, views))), views)
            if head.tag:
                self._on_notification(Notification(peer, head.tag))


def staged(segments: tuple[Segment, ...] | Segments) -> bool:
    """Many small ranges: moved through one staging buffer rather than a syscall each."""
    return isinstance(segments, Segments) and segments.small


def listed(segments: tuple[Segment, ...] | Segments) -> Sequence[Segment]:
    return segments.pairs() if isinstance(segments, Segments) else segments


def _refusal(head: FrameHead, region: memoryview | None) -> str:
    """Why a WRITE/READ cannot be served ('' when it can)."""
    if region is None:
        return "no layout is registered"
    if isinstance(head.segments, Segments):
        bad = head.segments.first_out_of_bounds(len(region))
    else:
        bad = next((segment for segment in head.segments if not segment_in_bounds(segment, len(region))), None)
    if bad is not None:
        return f"segment {tuple(bad)} is outside the registered region of {len(region)} bytes"
    total = head.segments.total_bytes if isinstance(head.segments, Segments) else sum(s.size_bytes for s in head.segments)
    if head.kind is FrameKind.WRITE and total > len(region):  # ranges written twice: never a transfer's
        return f"a write of {total} bytes is larger than the registered region of {len(region)} bytes"
    expected = total if head.kind is FrameKind.WRITE else 0
    if head.payload_bytes != expected:
        return f"payload of {head.payload_bytes} bytes does not match the segments ({expected} bytes)"
    return ""
