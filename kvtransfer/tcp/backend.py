"""TCP backend: length-prefixed frames over plain sockets, background threads, no extra dependency.

Per peer we hold one outgoing connection (a sender thread posting WRITE/READ/NOTIF frames in order, a
receiver thread taking ACK/DATA/ERROR); peers connect to our listener (tcp/server.py) to move bytes into
or out of our region. Host memory only. A lost connection fails every transfer on it with a reason.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from disagg.pd_config import TcpListenerConfig
from disagg.wire.auth import format_address
from kvtransfer.base import (
    BackendUnavailable, KVLayout, Notification, PeerUnavailable, TransferHandle, TransferOp, TransferState,
)
from kvtransfer.core import BackendCore, drain
from kvtransfer.descriptors import BlockRun, Segment, Segments, host_view, run_segments
from kvtransfer.handshake import PeerInfo
from kvtransfer.staging import stage
from kvtransfer.tcp.auth import greet
from kvtransfer.tcp.server import JOIN_TIMEOUT_S, InboundServer, shutdown_quietly
from kvtransfer.tcp.wire import FrameHead, FrameKind, ProtocolError, discard, read_head, recv_into_exact, send_frame
from kvtransfer.transfers import TransferTable


@dataclass(frozen=True)
class _Job:
    """One frame for the sender thread. `local` are the segments of our region it reads or fills; a
    transfer between TP sizes reads or fills `staging` instead (whole blocks, kvtransfer/staging.py),
    and a read then runs `finish` to hand our ranks their heads from it."""

    kind: FrameKind
    transfer_id: int
    local: tuple[Segment, ...] = ()
    remote: tuple[Segment, ...] | Segments = ()
    tag: bytes = b""
    staging: np.ndarray | None = None
    finish: Callable[[], None] | None = None


class _Link:
    """Our connection to one peer's listener."""

    def __init__(self, info: PeerInfo, sock: socket.socket, region: memoryview, transfers: TransferTable) -> None:
        self.peer = info.name
        self._sock = sock
        self._region = region
        self._transfers = transfers
        self._lock = threading.Lock()
        self._inflight: dict[int, _Job] = {}
        self._dead_reason = ""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None: stop
        self._threads = [
            threading.Thread(target=self._send_loop, name=f"kv-tcp-send-{self.peer}", daemon=True),
            threading.Thread(target=self._receive_loop, name=f"kv-tcp-recv-{self.peer}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: _Job) -> bool:
        """Queue a frame; False (and the transfer FAILED) when the connection is already gone."""
        with self._lock:
            if self._dead_reason:
                if job.transfer_id:
                    self._transfers.fail(job.transfer_id, self._dead_reason)
                return False
            if job.transfer_id:
                self._inflight[job.transfer_id] = job
        self._jobs.put(job)
        return True

    def forget(self, transfer_id: int) -> None:
        with self._lock:
            self._inflight.pop(transfer_id, None)

    def close(self) -> None:
        self._die(f"connection to peer {self.peer!r} closed")
        self._jobs.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(JOIN_TIMEOUT_S)

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead_reason:
                return
            self._dead_reason = reason
            orphans = list(self._inflight)
            self._inflight.clear()
        shutdown_quietly(self._sock)
        for transfer_id in orphans:
            self._transfers.fail(transfer_id, reason)

    def _is_live(self, transfer_id: int) -> bool:
        with self._lock:
            return transfer_id in self._inflight

    def _send_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.transfer_id and not self._is_live(job.transfer_id):
                continue  # aborted while queued
            try:
                self._send(job)
            except OSError as exc:
                self._die(f"connection to peer {self.peer!r} lost while sending: {exc}")
                return

    def _receive_loop(self) -> None:
        try:
            while True:
                self._on_reply(read_head(self._sock))
        except OSError as exc:
            self._die(f"connection to peer {self.peer!r} lost: {exc or type(exc).__name__}")

    def _on_reply(self, head: FrameHead) -> None:
        with self._lock:
            job = self._inflight.pop(head.transfer_id, None)
        if head.kind is FrameKind.DATA:
            if job is None:
                discard(self._sock, head.payload_bytes)  # aborted or released: never touch its blocks
                return
            if job.staging is not None:  # whole source blocks, then each local rank its heads
                recv_into_exact(self._sock, memoryview(job.staging))
                job.finish()
            for segment in job.local:
                recv_into_exact(self._sock, self._slice(segment))
        if job is None:
            return
        if head.kind is FrameKind.ERROR:
            self._transfers.fail(head.transfer_id, f"peer {self.peer!r} refused the transfer: {head.tag.decode()}")
        else:
            self._transfers.advance(head.transfer_id, TransferState.SUCCESS)

    def _send(self, job: _Job) -> None:
        if job.kind is not FrameKind.WRITE:
            payload = []
        elif job.staging is not None:  # the destination's blocks, assembled
            payload = [memoryview(job.staging)]
        else:
            payload = [self._slice(s) for s in job.local]
        send_frame(self._sock, FrameHead(job.kind, job.transfer_id, job.remote, job.tag, sum(map(len, payload))), payload)

    def _slice(self, segment: Segment) -> memoryview:
        return self._region[segment.offset_bytes: segment.offset_bytes + segment.size_bytes]


class TcpBackend(BackendCore):
    """Thread-safe notifications; transfers are posted and polled from one caller thread."""

    backend_name = "tcp"

    def __init__(self, agent_name: str | None = None, host: str = "127.0.0.1", connect_timeout_s: float = 5.0,
                 cluster_secret: str | None = None, listener: TcpListenerConfig = TcpListenerConfig()) -> None:
        super().__init__(agent_name)
        self._connect_timeout_s = connect_timeout_s
        self._cluster_secret = cluster_secret  # answers peers' challenges, and challenges every inbound peer
        self._inbox: deque[Notification] = deque()
        self._server = InboundServer(host, self._inbox.append, cluster_secret, listener)
        self._region: memoryview | None = None
        self._links: dict[str, _Link] = {}

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) of our listener."""
        return self._server.host, self._server.port

    @property
    def num_pending_connections(self) -> int:
        """Inbound connections in the handshake now (at most max_pending_connections)."""
        return self._server.num_pending

    @property
    def num_refused_connections(self) -> int:
        """Inbound connections closed at once because the handshake was full."""
        return self._server.num_refused_connections

    def _on_register(self, layout: KVLayout) -> None:
        if layout.is_cuda:
            raise BackendUnavailable(
                f"the tcp backend moves host memory only, the layout is on {layout.device}; use nixl"
            )
        self._region = host_view(layout)
        self._server.attach_region(self._region)

    def _on_deregister(self) -> None:
        self._server.detach_region()
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._region = None

    def _transport_info(self, info: PeerInfo) -> PeerInfo:
        return PeerInfo(info.backend, info.name, info.layout, host=self._server.host, port=self._server.port)

    def _on_add_peer(self, info: PeerInfo) -> None:
        """Connect and pass the peer's handshake (its challenge, when it holds a cluster secret) within
        the connect timeout; AuthenticationFailed when it refuses us, PeerUnavailable when unreachable."""
        assert self._region is not None
        deadline = time.monotonic() + self._connect_timeout_s
        target = format_address(info.host, info.port)
        who = f"peer {info.name!r} at {target}"
        try:
            sock = socket.create_connection((info.host, info.port), timeout=self._connect_timeout_s)
        except OSError as exc:
            raise PeerUnavailable(f"cannot connect to {who}: {exc}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            greet(sock, self._agent_name, self._cluster_secret, who, target, deadline)
            sock.settimeout(None)
        except ProtocolError as exc:
            shutdown_quietly(sock)
            raise PeerUnavailable(f"{who} broke the handshake: {exc}") from None
        except OSError as exc:
            shutdown_quietly(sock)
            raise PeerUnavailable(f"cannot connect to {who}: {exc or type(exc).__name__}") from None
        except BaseException:
            shutdown_quietly(sock)
            raise
        self._links[info.name] = _Link(info, sock, self._region, self._transfers)

    def _on_remove_peer(self, peer: str) -> None:
        link = self._links.pop(peer, None)
        if link is not None:
            link.close()

    def _cut_inbound(self, peer: str) -> bool:
        self._server.cut_peer(peer)  # a returning peer connects again (and is authenticated again)
        return True

    def _post(self, handle: TransferHandle, runs: list[BlockRun], notif_tag: bytes) -> None:
        assert self._layout is not None
        local, remote = run_segments(self._layout.block_size_bytes, runs)
        kind = FrameKind.WRITE if handle.op is TransferOp.WRITE else FrameKind.READ
        self._links[handle.peer].submit(_Job(kind, handle.transfer_id, tuple(local), tuple(remote), notif_tag))

    def _post_slices(self, handle: TransferHandle, block_ids: tuple[list[int], list[int]], notif_tag: bytes) -> None:
        """Whole blocks through a staging buffer (kvtransfer/staging.py): a write sends the destination's
        blocks assembled here, a read takes whole source blocks and hands our ranks their heads."""
        assert self._layout is not None and self._region is not None
        write, remote = handle.op is TransferOp.WRITE, self._peers[handle.peer].layout
        staged = stage(write, np.frombuffer(self._region, dtype=np.uint8), self._layout, remote, block_ids)
        offsets = staged.plan.remote_offsets
        blocks = Segments(offsets, np.full(len(offsets), staged.plan.block_bytes))
        job = _Job(FrameKind.WRITE if write else FrameKind.READ, handle.transfer_id, remote=blocks, tag=notif_tag,
                   staging=staged.buffer, finish=staged.finish)
        self._links[handle.peer].submit(job)

    def _progress(self, handle: TransferHandle) -> None:
        """Nothing to do: the link threads advance the state."""

    def _cancel(self, handle: TransferHandle) -> None:
        link = self._links.get(handle.peer)
        if link is not None:
            link.forget(handle.transfer_id)

    def _drain_notifications(self) -> list[Notification]:
        return drain(self._inbox)

    def _send_notification(self, peer: str, tag: bytes) -> None:
        if not self._links[peer].submit(_Job(FrameKind.NOTIF, 0, tag=tag)):
            raise PeerUnavailable(f"connection to peer {peer!r} is gone")

    def _on_close(self) -> None:
        self._server.close()
