"""The tcp backend's wire format and its refusals, with real sockets on 127.0.0.1."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from structlog.testing import capture_logs

from disagg.wire.auth import challenge_answer
from kvtransfer.base import BackendUnavailable, KVLayout, Notification, PeerUnavailable
from kvtransfer.descriptors import Segment
from kvtransfer.handshake import PeerInfo, encode_peer_info
from kvtransfer.tcp import auth as tcp_auth
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


@pytest.fixture
def guarded():
    memory = np.zeros(4 * 64, dtype=np.uint8)
    with TcpBackend("guarded", cluster_secret=SECRET) as tcp:
        tcp.register(KVLayout(memory.ctypes.data, 4, 64, 16, "float32"))
        yield tcp, memory


def challenged(tcp: TcpBackend) -> tuple[socket.socket, bytes]:
    conn = socket.create_connection(tcp.address, timeout=5)
    send_frame(conn, FrameHead(FrameKind.HELLO, tag=b"raw-client"))
    challenge = read_head(conn)
    assert (challenge.kind, len(challenge.tag)) == (FrameKind.CHALLENGE, 32)
    return conn, challenge.tag


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
        send_frame(conn, FrameHead(FrameKind.AUTH, tag=challenge_answer("other-secret", nonce)))
        assert read_head(conn) == FrameHead(FrameKind.ERROR, tag=b"cluster secret mismatch")
        assert_closed(conn)
    assert memory.sum() == 0


def test_the_right_answer_is_admitted_and_writes_land(guarded):
    tcp, memory = guarded
    conn, nonce = challenged(tcp)
    with conn:
        send_frame(conn, FrameHead(FrameKind.AUTH, tag=challenge_answer(SECRET, nonce)))
        assert read_head(conn) == FrameHead(FrameKind.ACK)
        send_frame(conn, FrameHead(FrameKind.WRITE, 4, (Segment(64, 4),), b"ok", 4), [memoryview(b"\x01\x02\x03\x04")])
        assert read_head(conn) == FrameHead(FrameKind.ACK, 4)
    assert memory[64:68].tolist() == [1, 2, 3, 4] and memory.sum() == 10


def test_a_silent_peer_is_dropped_at_the_handshake_deadline(guarded, monkeypatch):
    tcp, _ = guarded
    monkeypatch.setattr(tcp_auth, "HANDSHAKE_TIMEOUT_S", 0.2)
    conn, _ = challenged(tcp)
    with conn:
        conn.settimeout(5)
        assert_closed(conn)  # within 0.2 s of the challenge, not the 5 s we would wait


def test_a_listener_without_a_secret_admits_a_client_holding_one(backend):
    tcp, _ = backend
    region = np.zeros(4 * 64, dtype=np.uint8)
    with TcpBackend("client", cluster_secret=SECRET) as client:
        client.register(KVLayout(region.ctypes.data, 4, 64, 16, "float32"))
        assert client.add_peer(tcp.peer_metadata()) == "srv"  # unset on the listener: as without a secret
