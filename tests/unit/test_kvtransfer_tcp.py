"""The tcp backend's wire format and its refusals, with real sockets on 127.0.0.1."""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest
from structlog.testing import capture_logs

from disagg.pd_config import TcpListenerConfig
from disagg.wire.auth import KV_TCP, Binding, answer
from kvtransfer.base import BackendUnavailable, KVLayout, Notification, PeerUnavailable
from kvtransfer.descriptors import Segment, Segments
from kvtransfer.handshake import PeerInfo, encode_peer_info
from kvtransfer.tcp.auth import NO_ANSWER
from kvtransfer.tcp.backend import TcpBackend
from kvtransfer.tcp.wire import FrameHead, FrameKind, ProtocolError, encode_head, read_head, send_frame

pytestmark = pytest.mark.timeout(30)


def test_frame_head_round_trips_over_a_socket():
    left, right = socket.socketpair()
    with left, right:
        head = FrameHead(FrameKind.WRITE, 7, (Segment(0, 4), Segment(64, 2)), b"tag", 6)
        send_frame(left, head, [memoryview(b"abcd"), memoryview(b"ef")])
        assert read_head(right) == head
        assert right.recv(6) == b"abcdef"


def test_many_segments_travel_as_arrays():
    left, right = socket.socketpair()
    offsets, sizes = np.arange(20) * 256, np.full(20, 128)
    with left, right:
        send_frame(left, FrameHead(FrameKind.READ, 9, Segments(offsets, sizes), b"t"))
        head = read_head(right)
    assert isinstance(head.segments, Segments) and (head.kind, head.transfer_id, head.tag) == (FrameKind.READ, 9, b"t")
    assert head.segments.offsets.tolist() == offsets.tolist() and head.segments.sizes.tolist() == [128] * 20


def test_garbage_is_a_protocol_error():
    left, right = socket.socketpair()
    with left, right:
        left.sendall(b"\x63" + encode_head(FrameHead(FrameKind.ACK))[1:])
        with pytest.raises(ProtocolError, match="unknown frame kind 99"):
            read_head(right)


@pytest.fixture
def backend():
    memory = np.zeros(4 * 64, dtype=np.uint8)
    with TcpBackend("srv") as tcp:
        tcp.register(KVLayout(memory.ctypes.data, 4, 64, 16, "float32"))
        yield tcp, memory


def test_listener_refuses_out_of_bounds_writes_and_keeps_the_connection(backend):
    tcp, memory = backend
    with socket.create_connection(tcp.address, timeout=5) as conn:
        send_frame(conn, FrameHead(FrameKind.HELLO, tag=b"raw-client"))
        assert read_head(conn) == FrameHead(FrameKind.ACK)  # no cluster secret: admitted at once
        send_frame(conn, FrameHead(FrameKind.WRITE, 3, (Segment(200, 64),), b"bad", 64), [memoryview(bytes(range(64)))])
        reply = read_head(conn)
        assert reply == FrameHead(FrameKind.ERROR, 3, tag=b"segment (200, 64) is outside the registered region of 256 bytes")
        send_frame(conn, FrameHead(FrameKind.WRITE, 4, (Segment(64, 4),), b"ok", 4), [memoryview(b"\x01\x02\x03\x04")])
        assert read_head(conn) == FrameHead(FrameKind.ACK, 4)
    assert memory[64:68].tolist() == [1, 2, 3, 4] and memory.sum() == 10
    assert tcp.notifications() == [Notification("raw-client", b"ok")]


def test_unreachable_peer_is_reported(backend):
    tcp, _ = backend
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound but not listening: connections are refused
        metadata = encode_peer_info(PeerInfo("tcp", "ghost", tcp.registered_layout, host="127.0.0.1", port=port))
        with pytest.raises(PeerUnavailable, match=f"^cannot connect to peer 'ghost' at 127.0.0.1:{port}: "):
            tcp.add_peer(metadata)


def test_device_memory_is_refused():
    with TcpBackend() as tcp, pytest.raises(BackendUnavailable, match="tcp backend moves host memory only"):
        tcp.register(KVLayout(4096, 4, 64, 16, "float32", device="cuda:0"))


# --- the cluster secret's challenge ---------------------------------------------------------------

SECRET = "unit-secret"


def guarded_backend(name: str = "guarded", limits: TcpListenerConfig = TcpListenerConfig()):
    memory = np.zeros(4 * 64, dtype=np.uint8)
    tcp = TcpBackend(name, cluster_secret=SECRET, listener=limits)
    tcp.register(KVLayout(memory.ctypes.data, 4, 64, 16, "float32"))
    return tcp, memory


@pytest.fixture
def guarded():
    tcp, memory = guarded_backend()
    with tcp:
        yield tcp, memory


def challenged(tcp: TcpBackend) -> tuple[socket.socket, bytes]:
    conn = socket.create_connection(tcp.address, timeout=5)
    send_frame(conn, FrameHead(FrameKind.HELLO, tag=b"raw-client"))
    challenge = read_head(conn)
    assert (challenge.kind, len(challenge.tag)) == (FrameKind.CHALLENGE, 32)
    return conn, challenge.tag


def auth(nonce: bytes, tcp: TcpBackend, *, secret: str = SECRET, client: str = "raw-client",
         target: str | None = None) -> FrameHead:
    """The AUTH frame answering `nonce`, made for `target` (default: tcp's listener)."""
    binding = Binding(nonce, b"c" * 32, client, target or "{}:{}".format(*tcp.address))
    return FrameHead(FrameKind.AUTH, tag=answer(secret, KV_TCP, binding).encode())


def refusal_of(conn: socket.socket) -> str:
    """The ERROR the listener answered with, after which it closed the connection."""
    reply = read_head(conn)
    assert reply.kind is FrameKind.ERROR, reply
    assert_closed(conn)
    return reply.tag.decode()


def assert_closed(conn: socket.socket) -> None:
    with pytest.raises(ConnectionError, match="connection closed by the other side"):
        read_head(conn)


def test_a_write_before_the_challenge_is_answered_is_refused_and_never_lands(guarded):
    tcp, memory = guarded
    with capture_logs() as logs:
        conn, _ = challenged(tcp)
        with conn:
            # The head of a 64-byte write into block 0; the listener must refuse it without reading on.
            send_frame(conn, FrameHead(FrameKind.WRITE, 3, (Segment(0, 64),), b"sneak", 64))
            assert read_head(conn) == FrameHead(FrameKind.ERROR, 3, tag=NO_ANSWER.encode())
            assert_closed(conn)
    assert NO_ANSWER == "cluster secret required: answer the challenge before any other frame"
    assert memory.sum() == 0 and tcp.notifications() == []
    assert {"event": "kv connection refused", "log_level": "warning", "port": tcp.address[1], "peer": "raw-client",
            "reason": NO_ANSWER} in logs


def test_a_wrong_answer_is_refused(guarded):
    tcp, memory = guarded
    conn, nonce = challenged(tcp)
    with conn:
        send_frame(conn, auth(nonce, tcp, secret="other-secret"))
        assert read_head(conn) == FrameHead(FrameKind.ERROR, tag=b"cluster secret mismatch")
        assert_closed(conn)
    assert memory.sum() == 0


def test_the_right_answer_is_admitted_and_writes_land(guarded):
    tcp, memory = guarded
    conn, nonce = challenged(tcp)
    with conn:
        send_frame(conn, auth(nonce, tcp))
        assert read_head(conn) == FrameHead(FrameKind.ACK)
        send_frame(conn, FrameHead(FrameKind.WRITE, 4, (Segment(64, 4),), b"ok", 4), [memoryview(b"\x01\x02\x03\x04")])
        assert read_head(conn) == FrameHead(FrameKind.ACK, 4)
    assert memory[64:68].tolist() == [1, 2, 3, 4] and memory.sum() == 10


def test_a_silent_peer_is_dropped_at_the_handshake_deadline():
    tcp, _ = guarded_backend(limits=TcpListenerConfig(handshake_timeout_s=0.2))
    with tcp:
        conn, _ = challenged(tcp)
        with conn:
            conn.settimeout(5)
            started = time.monotonic()
            assert_closed(conn)  # within 0.2 s of the connection, not the 5 s we would wait
            assert time.monotonic() - started < 1.0


def test_a_trickling_peer_is_dropped_at_the_handshake_deadline_too():
    """The deadline bounds the whole handshake, not each read: one byte every 0.1 s does not extend it."""
    tcp, _ = guarded_backend(limits=TcpListenerConfig(handshake_timeout_s=0.5))
    with tcp, socket.create_connection(tcp.address, timeout=5) as conn:
        started = time.monotonic()
        hello = encode_head(FrameHead(FrameKind.HELLO, tag=b"slow-client"))
        with pytest.raises(OSError):
            for byte in hello:
                conn.sendall(bytes([byte]))
                time.sleep(0.1)
        assert time.monotonic() - started < 2.0  # the whole HELLO would take 3.9 s


def test_a_replayed_answer_is_refused():
    """The answer that admitted one connection, sent again on a new one, is refused: each once."""
    tcp, memory = guarded_backend()
    with tcp:
        first, nonce = challenged(tcp)
        with first:
            answered = auth(nonce, tcp)
            send_frame(first, answered)
            assert read_head(first) == FrameHead(FrameKind.ACK)
            with capture_logs() as logs:
                for _ in range(2):
                    replay, _ = challenged(tcp)
                    with replay:
                        send_frame(replay, answered)
                        assert refusal_of(replay) == USED
    assert [(e["event"], e["peer"], e["reason"]) for e in logs] == [("kv connection refused", "raw-client", USED)] * 2
    assert memory.sum() == 0


USED = "cluster secret proof was already used: this listener accepts each answer once"


def test_an_answer_made_for_another_listener_or_peer_is_refused():
    a, _ = guarded_backend("a")
    b, memory = guarded_backend("b")
    with a, b:
        target_a, target_b = "{}:{}".format(*a.address), "{}:{}".format(*b.address)
        conn, nonce = challenged(b)  # B's challenge, answered by a client that meant to reach A
        with conn:
            send_frame(conn, auth(nonce, b, target=target_a))
            assert refusal_of(conn) == f"cluster secret proof was made for {target_a}, this listener is {target_b}"
        conn, nonce = challenged(b)
        with conn:
            send_frame(conn, auth(nonce, b, client="decode-7"))
            assert refusal_of(conn) == "cluster secret proof was made for peer 'decode-7', this connection is 'raw-client'"
        to_a, nonce_of_a = challenged(a)
        conn, _ = challenged(b)
        with to_a, conn:
            send_frame(conn, auth(nonce_of_a, b))
            assert refusal_of(conn) == ("cluster secret proof answers no live challenge of this listener "
                                        "(unknown or expired nonce)")
        assert memory.sum() == 0 and b.notifications() == []


def all_bytes_until_closed(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(1 << 16):
        data += chunk
    return data


@pytest.mark.parametrize("hello", [False, True], ids=["before-hello", "after-hello"])
def test_an_unauthenticated_read_gets_no_byte_of_kv(guarded, hello):
    tcp, memory = guarded
    memory[:] = np.arange(memory.size) % 251 + 1
    with socket.create_connection(tcp.address, timeout=5) as conn:
        if hello:
            send_frame(conn, FrameHead(FrameKind.HELLO, tag=b"raw-client"))
            assert read_head(conn).kind is FrameKind.CHALLENGE
        send_frame(conn, FrameHead(FrameKind.READ, 5, (Segment(0, 256),), b"steal"))
        # Everything the listener sends until it closes: one ERROR frame, not one byte of the region.
        assert all_bytes_until_closed(conn) == encode_head(FrameHead(FrameKind.ERROR, 5, tag=NO_ANSWER.encode()))
    assert tcp.notifications() == []


def test_an_unauthenticated_write_with_its_payload_never_lands(guarded):
    tcp, memory = guarded
    conn, _ = challenged(tcp)
    with conn:
        try:
            send_frame(conn, FrameHead(FrameKind.WRITE, 6, (Segment(64, 64),), b"sneak", 64), [memoryview(b"\xff" * 64)])
        except OSError:
            pass  # the listener may close before the payload is out
        assert all_bytes_until_closed(conn) == encode_head(FrameHead(FrameKind.ERROR, 6, tag=NO_ANSWER.encode()))
    assert memory.sum() == 0 and tcp.notifications() == []


def closed_within(conns: list[socket.socket], started: float, timeout_s: float) -> list[float]:
    """When each connection saw the listener close it (seconds since `started`); fails past timeout_s."""
    closed = {}
    with selectors.DefaultSelector() as selector:
        for conn in conns:
            selector.register(conn, selectors.EVENT_READ)
        while len(closed) < len(conns) and time.monotonic() - started < timeout_s:
            for key, _ in selector.select(0.1):
                assert key.fileobj.recv(1) == b""  # nothing is ever sent before HELLO
                selector.unregister(key.fileobj)
                closed[key.fileobj] = time.monotonic() - started
    assert len(closed) == len(conns), f"{len(conns) - len(closed)} connections still open after {timeout_s} s"
    return [closed[conn] for conn in conns]


def test_a_flood_of_idle_connections_is_bounded_before_authentication():
    """200 connections that never speak: 16 are held (one thread each) until the handshake deadline,
    the other 184 are closed at once; the listener never runs more than 16 handshake threads."""
    tcp, _ = guarded_backend(limits=TcpListenerConfig(max_pending_connections=16, handshake_timeout_s=3.0))
    with tcp, capture_logs() as logs:
        baseline, started = threading.active_count(), time.monotonic()
        conns = [socket.create_connection(tcp.address, timeout=5) for _ in range(200)]
        try:
            for _ in range(500):  # the listener counts a connection pending just before its thread starts
                if tcp.num_refused_connections == 184 and threading.active_count() - baseline == 16:
                    break
                time.sleep(0.01)
            assert (tcp.num_refused_connections, tcp.num_pending_connections) == (184, 16)
            assert threading.active_count() - baseline == 16
            closed_at = closed_within(conns, started, timeout_s=10.0)
        finally:
            for conn in conns:
                conn.close()
        # The 184 before any of the first 16; those at their handshake deadline (3 s after their accept).
        assert max(closed_at[16:]) < min(closed_at[:16]) and 3.0 <= min(closed_at[:16]) and max(closed_at) < 5.0
        for _ in range(100):
            if threading.active_count() == baseline:
                break
            time.sleep(0.01)
        assert (threading.active_count() - baseline, tcp.num_pending_connections) == (0, 0)
    refused = [(e["event"], e["reason"]) for e in logs if e["event"] == "kv connection refused"]
    assert refused == [("kv connection refused", "16 connections are already in the handshake")] * 184
    dropped = [e["error"] for e in logs if e["event"] == "kv connection dropped during the handshake"]
    assert dropped == ["timed out"] * 16


TOO_LARGE = ("HELLO frame too large for the handshake: 1048576 segments, 65536 tag bytes, 0 payload bytes "
             "(at most 0, 2048, 0)")


@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no-secret"])
@pytest.mark.parametrize("kind, reason", [
    (FrameKind.HELLO, TOO_LARGE),
    (FrameKind.WRITE, None),  # with a secret: no answer yet; without: not a HELLO
])
def test_an_oversized_header_before_authentication_is_refused_without_reading_on(secret, kind, reason):
    """A header declaring 16 MiB of segments and 64 KiB of tag: refused at once from its 28 bytes, nothing
    more read (nothing more is sent: a listener reading on would wait) and nothing allocated for it."""
    memory = np.zeros(4 * 64, dtype=np.uint8)
    with TcpBackend("listener", cluster_secret=secret) as tcp, capture_logs() as logs:
        tcp.register(KVLayout(memory.ctypes.data, 4, 64, 16, "float32"))
        header = struct.pack("<B3xIIQQ", kind, 1 << 20, 1 << 16, 9, 0)
        with socket.create_connection(tcp.address, timeout=5) as conn:
            tracemalloc.start()
            try:
                started = time.monotonic()
                conn.sendall(header)
                received = all_bytes_until_closed(conn)
                elapsed_s, peak_bytes = time.monotonic() - started, tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    expected = reason or (NO_ANSWER if secret else "expected HELLO, got WRITE")
    assert received == encode_head(FrameHead(FrameKind.ERROR, 9, tag=expected.encode()))
    assert elapsed_s < 1.0 and peak_bytes < 256 * 1024  # reading the declared frame would take 16 MiB
    assert [(e["event"], e["reason"]) for e in logs if e["event"] == "kv connection refused"] == [
        ("kv connection refused", expected)]
    assert memory.sum() == 0


def test_a_listener_without_a_secret_admits_a_client_holding_one(backend):
    tcp, _ = backend
    region = np.zeros(4 * 64, dtype=np.uint8)
    with TcpBackend("client", cluster_secret=SECRET) as client:
        client.register(KVLayout(region.ctypes.data, 4, 64, 16, "float32"))
        assert client.add_peer(tcp.peer_metadata()) == "srv"  # unset on the listener: as without a secret


def test_a_write_larger_than_the_region_is_refused_before_any_byte_is_read():
    from kvtransfer.tcp.server import _refusal

    region = memoryview(bytearray(256))
    twice = Segments(np.zeros(20, dtype=np.int64), np.full(20, 16))  # 320 bytes, all into the first 16
    assert _refusal(FrameHead(FrameKind.WRITE, 1, twice, b"", 320), region) == (
        "a write of 320 bytes is larger than the registered region of 256 bytes")
    assert _refusal(FrameHead(FrameKind.READ, 2, twice, b"", 0), region) == ""  # a read sends what it reads
    outside = Segments(np.arange(20) * 14, np.full(20, 8))  # 160 bytes, the last two past the end
    assert _refusal(FrameHead(FrameKind.WRITE, 3, outside, b"", 160), region) == (
        "segment (252, 8) is outside the registered region of 256 bytes")
