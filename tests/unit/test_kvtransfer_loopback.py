"""Two loopback endpoints in one process: the whole lifecycle and every caller error, in microseconds."""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer.base import (
    BackendClosed, BackendUnavailable, InvalidBlockIds, KVLayout, KVTransferBackend, KVTransferError, Notification,
    NotRegistered, PeerUnavailable, TransferState, TransferStatus, UnknownTransfer, wait,
)
from kvtransfer.loopback import LoopbackBackend, LoopbackFabric

BLOCK = 64


def region(num_blocks: int = 8, fill: int = 0) -> tuple[np.ndarray, KVLayout]:
    memory = np.full(num_blocks * BLOCK, fill, dtype=np.uint8)
    return memory, KVLayout(memory.ctypes.data, num_blocks, BLOCK, 16, "float32")


@pytest.fixture
def endpoints():
    fabric = LoopbackFabric()
    a, b = LoopbackBackend(fabric, "a"), LoopbackBackend(fabric, "b")
    mem_a, layout_a = region(fill=0)
    mem_b, layout_b = region(fill=0)
    mem_a[:] = np.arange(mem_a.size) % 251
    a.register(layout_a)
    b.register(layout_b)
    assert a.add_peer(b.peer_metadata()) == "b"
    yield fabric, a, b, mem_a, mem_b
    a.close()
    b.close()


def test_is_a_kv_transfer_backend(endpoints):
    _, a, *_ = endpoints
    assert isinstance(a, KVTransferBackend)
    assert (a.backend_name, a.agent_name) == ("loopback", "a")


def test_write_read_and_notifications(endpoints):
    _, a, b, mem_a, mem_b = endpoints
    handle = a.write("b", [0, 1, 5], [6, 7, 2], b"room-1")
    assert (handle.peer, handle.num_blocks, handle.num_bytes) == ("b", 3, 3 * BLOCK)
    assert a.poll(handle) == TransferStatus(TransferState.SUCCESS)
    assert mem_b[6 * BLOCK: 8 * BLOCK].tolist() == mem_a[0: 2 * BLOCK].tolist()
    assert mem_b[2 * BLOCK: 3 * BLOCK].tolist() == mem_a[5 * BLOCK: 6 * BLOCK].tolist()
    assert not mem_b[: 2 * BLOCK].any() and not mem_b[3 * BLOCK: 6 * BLOCK].any()
    assert b.notifications() == [Notification("a", b"room-1")]
    assert b.notifications() == []
    mem_b[3 * BLOCK: 4 * BLOCK] = 9
    assert wait(a, a.read("b", [4], [3], b"pulled"), 1.0).ok
    assert set(mem_a[4 * BLOCK: 5 * BLOCK].tolist()) == {9}
    assert b.notifications() == [Notification("a", b"pulled")]
    a.notify("b", b"standalone")
    assert b.notifications() == [Notification("a", b"standalone")]


def test_suspended_peer_holds_transfers_until_resumed(endpoints):
    fabric, a, _, _, mem_b = endpoints
    fabric.suspend("b")
    handle = a.write("b", [1], [1], b"")
    assert a.poll(handle).state is TransferState.TRANSFERRING
    assert not mem_b.any()
    fabric.resume("b")
    assert a.poll(handle).ok and mem_b.any()


def test_abort_then_release_drops_late_completion(endpoints):
    fabric, a, b, _, mem_b = endpoints
    fabric.suspend("b")
    handle = a.write("b", [1], [1], b"late")
    a.abort(handle, "caller gave up")
    fabric.resume("b")
    assert a.poll(handle) == TransferStatus(TransferState.FAILED, "caller gave up")
    assert not mem_b.any() and b.notifications() == []
    a.release(handle)
    with pytest.raises(UnknownTransfer):
        a.poll(handle)


def test_closed_peer_fails_pending_transfers_with_its_name(endpoints):
    fabric, a, b, _, _ = endpoints
    fabric.suspend("b")
    handle = a.write("b", [1], [1], b"")
    b.close()
    assert a.poll(handle) == TransferStatus(TransferState.FAILED, "peer 'b' is closed")


def test_remove_peer_fails_its_live_transfers(endpoints):
    fabric, a, _, _, _ = endpoints
    fabric.suspend("b")
    handle = a.write("b", [1], [1], b"")
    a.remove_peer("b")
    assert a.poll(handle) == TransferStatus(TransferState.FAILED, "peer 'b' was removed")
    with pytest.raises(PeerUnavailable, match="unknown peer 'b'; add_peer"):
        a.write("b", [1], [1], b"")


def test_caller_errors_raise(endpoints):
    _, a, _, _, _ = endpoints
    with pytest.raises(InvalidBlockIds, match="remote block id 8 is out of range"):
        a.write("b", [0], [8], b"")
    with pytest.raises(KVTransferError, match="a: a layout is already registered; deregister\\(\\) first"):
        a.register(a.registered_layout)
    fresh = LoopbackBackend(LoopbackFabric())
    with pytest.raises(NotRegistered):
        fresh.peer_metadata()
    with pytest.raises(BackendUnavailable, match="host memory only, the layout is on cuda:0; use nixl"):
        fresh.register(KVLayout(4096, 1, 64, 16, "float32", "cuda:0"))
    fresh.close()
    with pytest.raises(BackendClosed):
        fresh.notifications()


def test_deregister_fails_live_transfers_and_forgets_peers(endpoints):
    fabric, a, _, _, _ = endpoints
    fabric.suspend("b")
    handle = a.write("b", [1], [1], b"")
    a.deregister()
    assert a.registered_layout is None
    assert a.poll(handle) == TransferStatus(TransferState.FAILED, "local layout deregistered")
    _, layout = region(num_blocks=4)
    a.register(layout)
    with pytest.raises(PeerUnavailable):
        a.write("b", [1], [1], b"")


def test_context_manager_closes():
    with LoopbackBackend() as backend:
        backend.register(region()[1])
    assert backend.registered_layout is None
