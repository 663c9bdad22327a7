"""One contract for every KV transfer backend, between two real processes (loopback: in-process twin).

The peer (kv_peer.py) owns a 64 x 4 KiB region of zeros; this process owns another. Checks compare
sha256 of every block, so a stray byte anywhere fails the test. `tcp+secret` is the tcp backend with a
cluster secret on both sides: every connection passes the listener's challenge first.
"""

from __future__ import annotations

import collections
import os
import pathlib
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import kv_peer
import msgspec
import numpy as np
import pytest

from kvtransfer.base import (
    BackendClosed, KVLayout, LayoutMismatch, TransferState, TransferStatus, UnknownTransfer, wait, wait_all,
)
from kvtransfer.factory import create_backend
from kvtransfer.loopback import LoopbackBackend, LoopbackFabric
from kvtransfer.nixl import nixl_installed

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEER_SCRIPT = pathlib.Path(kv_peer.__file__).resolve()
NUM_BLOCKS, BLOCK_BYTES, BLOCK_TOKENS, DTYPE = 64, 4096, 16, "bfloat16"
TIMEOUT_S = 10.0
SECRET = "contract-secret"
BACKENDS = [
    "loopback", "tcp", "tcp+secret",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed")),
]


def backend_of(kind: str) -> tuple[str, str | None]:
    """`tcp+secret` -> ("tcp", SECRET); a plain backend name -> (name, None)."""
    name, _, with_secret = kind.partition("+")
    return name, SECRET if with_secret else None


def open_backend(kind: str, fabric: LoopbackFabric, secret: str | None = None):
    name, default_secret = backend_of(kind)
    return create_backend(name, fabric=fabric, cluster_secret=secret or default_secret)


class ProcessPeer:
    """kv_peer.py in its own process; commands over a pipe, every read bounded by a deadline."""

    def __init__(self, kind: str, *, stallable: bool = False, secret: str | None = None) -> None:
        backend, default_secret = backend_of(kind)
        secret = secret or default_secret
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        if stallable and backend == "nixl":
            # UCX's shared-memory puts are one-sided: they land in a SIGSTOPped process. Over TCP they need
            # the peer's progress thread, so stopping the peer really stalls the transfer.
            env["UCX_TLS"] = "tcp"
        command = [sys.executable, str(PEER_SCRIPT), "--backend", backend, "--num-blocks", str(NUM_BLOCKS),
                   "--block-bytes", str(BLOCK_BYTES), "--block-tokens", str(BLOCK_TOKENS), "--dtype", DTYPE]
        if secret is not None:
            command += ["--cluster-secret", secret]
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buffer = b""
        hello = self._read_reply(30.0)
        self.name: str = hello["name"]
        self.metadata = bytes.fromhex(hello["metadata"])

    def call(self, op: str, **args: object) -> dict:
        reply = self.try_call(op, **args)
        assert "error" not in reply, reply["error"]
        return reply

    def try_call(self, op: str, **args: object) -> dict:
        """The reply as it is: `{"error": "<type>: <message>"}` when the command raised."""
        self._proc.stdin.write(msgspec.json.encode({"op": op, **args}) + b"\n")
        self._proc.stdin.flush()
        return self._read_reply(TIMEOUT_S + 5)

    def _read_reply(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"peer gave no answer within {timeout_s} s")
            if select.select([fd], [], [], remaining)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise ConnectionError(f"peer exited with status {self._proc.wait(5)}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return msgspec.json.decode(line)

    def stop(self) -> None:
        """SIGSTOP, and wait until the kernel reports the process stopped (the signal is asynchronous)."""
        os.kill(self._proc.pid, signal.SIGSTOP)
        stat = pathlib.Path(f"/proc/{self._proc.pid}/stat")
        deadline = time.monotonic() + TIMEOUT_S
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline, "peer did not stop"
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self._proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait(TIMEOUT_S)

    def close(self) -> None:
        if self._proc.poll() is None:
            self.resume()
            try:
                self._proc.stdin.write(b'{"op": "exit"}\n')
                self._proc.stdin.flush()
                self._proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        self._proc.stdin.close()
        self._proc.stdout.close()


class InProcessPeer:
    """The same peer on a LoopbackFabric in this process; stop/resume suspend it, kill closes it."""

    def __init__(self, fabric: LoopbackFabric) -> None:
        self._fabric = fabric
        self._state = kv_peer.PeerState(LoopbackBackend(fabric), NUM_BLOCKS, BLOCK_BYTES, BLOCK_TOKENS, DTYPE)
        hello = self._state.hello()
        self.name: str = hello["name"]
        self.metadata = bytes.fromhex(hello["metadata"])

    def call(self, op: str, **args: object) -> dict:
        return self._state.handle({"op": op, **args})

    def stop(self) -> None:
        self._fabric.suspend(self.name)

    def resume(self) -> None:
        self._fabric.resume(self.name)

    def kill(self) -> None:
        self._state.backend.close()

    def close(self) -> None:
        self._state.backend.close()


class Local:
    """This process's side: a region of zeros and a registered backend."""

    def __init__(self, kind: str, fabric: LoopbackFabric, secret: str | None = None) -> None:
        self.memory = np.zeros(NUM_BLOCKS * BLOCK_BYTES, dtype=np.uint8)
        self.layout = KVLayout(self.memory.ctypes.data, NUM_BLOCKS, BLOCK_BYTES, BLOCK_TOKENS, DTYPE)
        self.backend = open_backend(kind, fabric, secret)
        self.backend.register(self.layout)

    def fill(self, block_ids: list[int], seed: int) -> list[str]:
        return kv_peer.fill_blocks(self.memory, block_ids, BLOCK_BYTES, seed)

    def checksums(self) -> list[str]:
        return [kv_peer.block_checksum(self.memory, block_id, BLOCK_BYTES) for block_id in range(NUM_BLOCKS)]


@dataclass
class Pair:
    backend: str
    fabric: LoopbackFabric
    local: Local
    peer: ProcessPeer | InProcessPeer
    peer_name: str  # the peer as the local backend knows it


def make_peer(backend: str, fabric: LoopbackFabric, *, stallable: bool = False) -> ProcessPeer | InProcessPeer:
    return InProcessPeer(fabric) if backend == "loopback" else ProcessPeer(backend, stallable=stallable)


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest) -> Pair:
    """A long-lived peer and local backend that added each other (for tests that leave both healthy)."""
    fabric = LoopbackFabric()
    peer = make_peer(request.param, fabric)
    local = Local(request.param, fabric)
    peer_name = local.backend.add_peer(peer.metadata)
    peer.call("add_peer", metadata=local.backend.peer_metadata().hex())
    yield Pair(request.param, fabric, local, peer, peer_name)
    local.backend.close()
    peer.close()


def peer_tags(peer: ProcessPeer | InProcessPeer, expect: int) -> list[tuple[str, bytes]]:
    """Notifications the peer got: waits for `expect`, then a grace period that would catch duplicates."""
    got = peer.call("notifications", expect=expect, timeout_s=TIMEOUT_S)["notifications"]
    got += peer.call("notifications", expect=len(got) + 1, timeout_s=0.1)["notifications"]
    return [(name, bytes.fromhex(tag)) for name, tag in got]


def expected_after(before: list[str], dst: list[int], sums: list[str]) -> list[str]:
    expected = list(before)
    for block_id, checksum in zip(dst, sums):
        expected[block_id] = checksum
    return expected


def test_write_lands_exactly_and_leaves_other_blocks_alone(pair: Pair) -> None:
    before = pair.peer.call("checksums")["checksums"]
    src, dst = [3, 4, 5, 10], [7, 8, 9, 20]
    sums = pair.local.fill(src, seed=1)
    handle = pair.local.backend.write(pair.peer_name, src, dst, b"w-exact")
    assert wait(pair.local.backend, handle, TIMEOUT_S) == TransferStatus(TransferState.SUCCESS)
    assert pair.peer.call("checksums")["checksums"] == expected_after(before, dst, sums)
    assert peer_tags(pair.peer, 1) == [(pair.local.backend.agent_name, b"w-exact")]
    pair.local.backend.release(handle)


@pytest.mark.parametrize(("src", "dst"), [
    ([0], [63]),  # one block, last slot
    ([1, 2, 3], [40, 41, 42]),  # contiguous on both sides: one range
    ([7, 6, 5], [10, 11, 12]),  # descending source
    ([11, 13, 15], [30, 31, 32]),  # gaps in the source
    ([20, 21, 22, 23], [50, 52, 51, 53]),  # contiguous source, shuffled destination
])
def test_partial_and_non_contiguous_writes(pair: Pair, src: list[int], dst: list[int]) -> None:
    before = pair.peer.call("checksums")["checksums"]
    sums = pair.local.fill(src, seed=sum(src))
    handle = pair.local.backend.write(pair.peer_name, src, dst, b"w-partial")
    assert wait(pair.local.backend, handle, TIMEOUT_S).state is TransferState.SUCCESS
    assert pair.peer.call("checksums")["checksums"] == expected_after(before, dst, sums)
    assert peer_tags(pair.peer, 1) == [(pair.local.backend.agent_name, b"w-partial")]


def test_read_lands_exactly_and_notifies_the_owner(pair: Pair) -> None:
    remote, local_ids = [44, 45, 46, 60], [30, 31, 32, 12]
    sums = pair.peer.call("fill", block_ids=remote, seed=7)["checksums"]
    before = pair.local.checksums()
    handle = pair.local.backend.read(pair.peer_name, local_ids, remote, b"r-exact")
    assert wait(pair.local.backend, handle, TIMEOUT_S).state is TransferState.SUCCESS
    assert pair.local.checksums() == expected_after(before, local_ids, sums)
    assert peer_tags(pair.peer, 1) == [(pair.local.backend.agent_name, b"r-exact")]


def test_concurrent_transfers_all_land_and_each_tag_arrives_once(pair: Pair) -> None:
    before = pair.peer.call("checksums")["checksums"]
    handles, expected = [], list(before)
    for k in range(8):
        src, dst = list(range(4 * k, 4 * k + 4)), list(range(32 + 4 * k, 36 + 4 * k))
        for block_id, checksum in zip(dst, pair.local.fill(src, seed=100 + k)):
            expected[block_id] = checksum
        handles.append(pair.local.backend.write(pair.peer_name, src, dst, f"c-{k}".encode()))
    statuses = wait_all(pair.local.backend, handles, TIMEOUT_S)
    assert [s.state for s in statuses] == [TransferState.SUCCESS] * 8
    assert pair.peer.call("checksums")["checksums"] == expected
    tags = collections.Counter(tag for _, tag in peer_tags(pair.peer, 8))
    assert tags == collections.Counter(f"c-{k}".encode() for k in range(8))


def test_peer_writes_into_us_and_we_get_its_tag(pair: Pair) -> None:
    sums = pair.peer.call("fill", block_ids=[1, 2], seed=11)["checksums"]
    before = pair.local.checksums()
    reply = pair.peer.call("write", peer=pair.local.backend.agent_name, local=[1, 2], remote=[60, 61],
                           tag=b"from-peer".hex(), timeout_s=TIMEOUT_S)
    assert reply == {"state": "SUCCESS", "reason": ""}
    assert pair.local.checksums() == expected_after(before, [60, 61], sums)
    deadline, got = time.monotonic() + TIMEOUT_S, []
    while not got and time.monotonic() < deadline:
        got += pair.local.backend.notifications()
        time.sleep(0.002)
    time.sleep(0.05)
    got += pair.local.backend.notifications()
    assert [(n.peer, n.tag) for n in got] == [(pair.peer.name, b"from-peer")]


def test_standalone_notification_arrives_once(pair: Pair) -> None:
    pair.local.backend.notify(pair.peer_name, b"ping-1")
    assert peer_tags(pair.peer, 1) == [(pair.local.backend.agent_name, b"ping-1")]


def test_layout_mismatch_is_refused_with_both_values(pair: Pair) -> None:
    backend = pair.local.backend
    cases = [
        (KVLayout(pair.local.layout.base_address, NUM_BLOCKS, BLOCK_BYTES, 32, DTYPE),
         f"KV layout mismatch with peer {pair.peer.name!r}: block_size_tokens is 16 there and 32 here"),
        (KVLayout(pair.local.layout.base_address, NUM_BLOCKS, BLOCK_BYTES, BLOCK_TOKENS, "float32"),
         f"KV layout mismatch with peer {pair.peer.name!r}: dtype is 'bfloat16' there and 'float32' here"),
        (KVLayout(pair.local.layout.base_address, NUM_BLOCKS // 2, 2 * BLOCK_BYTES, BLOCK_TOKENS, DTYPE),
         f"KV layout mismatch with peer {pair.peer.name!r}: block_size_bytes is 4096 there and 8192 here"),
    ]
    try:
        for layout, message in cases:
            backend.deregister()
            backend.register(layout)
            with pytest.raises(LayoutMismatch) as excinfo:
                backend.add_peer(pair.peer.metadata)
            assert str(excinfo.value) == message
    finally:
        backend.deregister()
        backend.register(pair.local.layout)
        assert backend.add_peer(pair.peer.metadata) == pair.peer_name
        pair.peer.call("add_peer", metadata=backend.peer_metadata().hex())


def test_close_releases_the_registration(pair: Pair) -> None:
    local = Local(pair.backend, pair.fabric)
    name = local.backend.add_peer(pair.peer.metadata)
    handle = local.backend.write(name, [0], [0], b"")
    assert wait(local.backend, handle, TIMEOUT_S).state is TransferState.SUCCESS
    local.backend.close()
    assert local.backend.registered_layout is None
    with pytest.raises(BackendClosed):
        local.backend.write(name, [0], [0], b"")
    with pytest.raises(BackendClosed):
        local.backend.register(local.layout)
    local.backend.close()  # idempotent
    with open_backend(pair.backend, pair.fabric) as again:
        again.register(local.layout)
        name = again.add_peer(pair.peer.metadata)
        assert wait(again, again.write(name, [1], [1], b""), TIMEOUT_S).state is TransferState.SUCCESS
    assert again.registered_layout is None


def test_peer_killed_mid_transfer_fails_with_reason_before_the_deadline(pair: Pair) -> None:
    peer = make_peer(pair.backend, pair.fabric, stallable=True)
    local = Local(pair.backend, pair.fabric)
    try:
        name = local.backend.add_peer(peer.metadata)
        local.fill(list(range(NUM_BLOCKS)), seed=3)
        peer.stop()
        handle = local.backend.write(name, range(NUM_BLOCKS), range(NUM_BLOCKS), b"doomed")
        assert local.backend.poll(handle).state is TransferState.TRANSFERRING
        peer.kill()
        started = time.monotonic()
        status = wait(local.backend, handle, TIMEOUT_S)
        assert time.monotonic() - started < TIMEOUT_S / 2
        assert status.state is TransferState.FAILED
        assert repr(name) in status.reason and "deadline" not in status.reason
        later = wait(local.backend, local.backend.write(name, [0], [0], b"late"), TIMEOUT_S)
        assert later.state is TransferState.FAILED and repr(name) in later.reason
    finally:
        local.backend.close()
        peer.close()


def test_deadline_expiry_fails_the_transfer_and_late_completion_is_dropped(pair: Pair) -> None:
    peer = make_peer(pair.backend, pair.fabric, stallable=True)
    local = Local(pair.backend, pair.fabric)
    try:
        name = local.backend.add_peer(peer.metadata)
        peer.stop()
        handle = local.backend.write(name, range(NUM_BLOCKS), range(NUM_BLOCKS), b"slow")
        started = time.monotonic()
        status = wait(local.backend, handle, 0.3)
        assert 0.3 <= time.monotonic() - started < 3
        assert status == TransferStatus(TransferState.FAILED, "deadline exceeded after 0.3 s")
        peer.resume()
        after = local.backend.write(name, [0], [1], b"after")  # ordered behind the late one on the wire
        assert wait(local.backend, after, TIMEOUT_S).state is TransferState.SUCCESS
        assert local.backend.poll(handle) == status
        local.backend.release(handle)
        with pytest.raises(UnknownTransfer):
            local.backend.poll(handle)
    finally:
        local.backend.close()
        peer.close()


