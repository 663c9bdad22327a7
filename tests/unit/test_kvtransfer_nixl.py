"""Two NIXL agents in one process (NIXL's own testing style): lifecycle, deregistration, helpers."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from kvtransfer.base import KVLayout, Notification, TransferState, TransferStatus, wait
from kvtransfer.descriptors import BlockRun
from kvtransfer.nixl import _block_array, _mem_type, _run_indices, nixl_installed

pytestmark = [pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed"), pytest.mark.timeout(60)]
BLOCK = 4096


@pytest.fixture(scope="module")
def agents():
    from kvtransfer.nixl import NixlBackend

    logging.getLogger("nixl").setLevel(logging.WARNING)
    mem_a = (np.arange(16 * BLOCK) % 253).astype(np.uint8)
    mem_b = np.zeros(16 * BLOCK, dtype=np.uint8)
    a, b = NixlBackend("unit-a"), NixlBackend("unit-b")
    a.register(KVLayout(mem_a.ctypes.data, 16, BLOCK, 16, "bfloat16"))
    b.register(KVLayout(mem_b.ctypes.data, 16, BLOCK, 16, "bfloat16"))
    assert a.add_peer(b.peer_metadata()) == "unit-b"
    yield a, b, mem_a, mem_b
    a.close()
    b.close()


def drain(backend, count: int, timeout_s: float = 5.0) -> list[Notification]:
    got: list[Notification] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += backend.notifications()
        time.sleep(0.001)
    return got


def test_write_and_read_between_two_agents(agents):
    a, b, mem_a, mem_b = agents
    handle = a.write("unit-b", [0, 1, 2, 9], [3, 4, 5, 0], b"nixl-w")
    assert wait(a, handle, 5.0) == TransferStatus(TransferState.SUCCESS)
    assert np.array_equal(mem_b[3 * BLOCK: 6 * BLOCK], mem_a[: 3 * BLOCK])
    assert np.array_equal(mem_b[: BLOCK], mem_a[9 * BLOCK: 10 * BLOCK])
    assert not mem_b[BLOCK: 3 * BLOCK].any()
    assert drain(b, 1) == [Notification("unit-a", b"nixl-w")]
    mem_b[7 * BLOCK: 8 * BLOCK] = 5
    assert wait(a, a.read("unit-b", [15], [7], b"nixl-r"), 5.0).ok
    assert set(mem_a[15 * BLOCK:].tolist()) == {5}
    assert drain(b, 1) == [Notification("unit-a", b"nixl-r")]
    a.release(handle)


def test_deregister_really_releases_the_nixl_registration():
    from kvtransfer.nixl import NixlBackend

    memory = np.zeros(4 * BLOCK, dtype=np.uint8)
    backend = NixlBackend()
    backend.register(KVLayout(memory.ctypes.data, 4, BLOCK, 16, "bfloat16"))
    agent = backend._agent  # the test looks behind the seam on purpose: is NIXL's registration gone?
    agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(memory.ctypes.data, BLOCK, 0)], "DRAM").release()
    backend.deregister()
    with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(memory.ctypes.data, BLOCK, 0)], "DRAM")
    backend.register(KVLayout(memory.ctypes.data, 4, BLOCK, 16, "bfloat16"))
    backend.close()
    assert backend.registered_layout is None


def test_agent_construction_leaves_nixl_config_class_untouched():
    from kvtransfer.nixl import NixlBackend, load_nixl

    api = load_nixl()
    original = api.nixlBind.nixlAgentConfig
    NixlBackend().close()
    assert api.nixlBind.nixlAgentConfig is original


def test_descriptor_helpers():
    layout = KVLayout(0x1000, 3, 0x100, 16, "bfloat16", device="cuda:2")
    assert _mem_type(layout) == "VRAM"
    assert _block_array(layout).tolist() == [[0x1000, 0x100, 2], [0x1100, 0x100, 2], [0x1200, 0x100, 2]]
    local, remote = _run_indices([BlockRun(4, 0, 2), BlockRun(9, 7, 1)])
    assert local.tolist() == [4, 5, 9] and remote.tolist() == [0, 1, 7]
