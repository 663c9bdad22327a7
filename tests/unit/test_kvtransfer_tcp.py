"""The tcp backend's wire format and its refusals, with real sockets on 127.0.0.1."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from kvtransfer.base import BackendUnavailable, KVLayout, Notification, PeerUnavailable
from kvtransfer.descriptors import Segment
from kvtransfer.handshake import PeerInfo, encode_peer_info
from kvtransfer.tcp import TcpBackend
from kvtransfer.tcp_wire import FrameHead, FrameKind, ProtocolError, encode_head, read_head, send_frame

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
