"""BackendCore: the part every backend shares (validation, handshake, handles, state, lifecycle).

A backend subclasses it and fills in the transport hooks (`_on_register`, `_post`, `_progress`, ...).
The public methods here implement KVTransferBackend; the hooks never see unvalidated input.
"""

from __future__ import annotations

import abc
import itertools
import uuid
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from kvtransfer.base import (
    BackendClosed, KVLayout, KVTransferError, Notification, NotRegistered, PeerUnavailable, TransferHandle,
    TransferOp, TransferStatus,
)
from kvtransfer.descriptors import BlockRun, Descriptor, check_block_pairs, describe, pair_runs, rank_runs
from kvtransfer.handshake import PeerInfo, check_compatible, decode_peer_info, encode_peer_info
from kvtransfer.heads import same_split
from kvtransfer.transfers import TransferTable


def drain(inbox: "deque[Notification]") -> list[Notification]:
    """Pop everything queued so far, oldest first (thread-safe for deque appends from another thread)."""
    drained = []
    while inbox:
        drained.append(inbox.popleft())
    return drained


class BackendCore(abc.ABC):
    backend_name: ClassVar[str]

    def __init__(self, agent_name: str | None = None) -> None:
        self._agent_name = agent_name or f"{self.backend_name}-{uuid.uuid4().hex[:12]}"
        self._layout: KVLayout | None = None
        self._peers: dict[str, PeerInfo] = {}
        self._transfers = TransferTable()
        self._handles: dict[int, TransferHandle] = {}
        self._ids = itertools.count(1)
        self._closed = False

    # -- transport hooks -------------------------------------------------------------------------

    @abc.abstractmethod
    def _on_register(self, layout: KVLayout) -> None:
        """Register the region with the transport."""

    @abc.abstractmethod
    def _on_deregister(self) -> None:
        """Release the transport's registration, peers and in-flight work (all already FAILED)."""

    @abc.abstractmethod
    def _transport_info(self, info: PeerInfo) -> PeerInfo:
        """Our PeerInfo with the transport fields (host/port, agent metadata) filled in."""

    @abc.abstractmethod
    def _on_add_peer(self, info: PeerInfo) -> None:
        """Connect to / load the peer. Raise PeerUnavailable when it cannot be reached."""

    @abc.abstractmethod
    def _on_remove_peer(self, peer: str) -> None:
        """Drop the peer's transport state (its transfers are already FAILED)."""

    @abc.abstractmethod
    def _post(self, handle: TransferHandle, runs: list[BlockRun], notif_tag: bytes) -> None:
        """Start the transfer; report completion through self._transfers."""

    @abc.abstractmethod
    def _post_slices(self, handle: TransferHandle, block_ids: tuple[list[int], list[int]], notif_tag: bytes) -> None:
        """Start a transfer between caches of different TP sizes, of these (local, remote) block ids:
        whole blocks through a staging buffer (kvtransfer/staging.py), or on device memory the head
        slices themselves (kvtransfer/heads.py)."""

    @abc.abstractmethod
    def _progress(self, handle: TransferHandle) -> None:
        """Advance a live transfer (backends whose completion needs polling)."""

    @abc.abstractmethod
    def _cancel(self, handle: TransferHandle) -> None:
        """Stop a transfer that was just marked FAILED, as far as the transport allows."""

    @abc.abstractmethod
    def _drain_notifications(self) -> list[Notification]:
        """Notifications that arrived since the last call."""

    @abc.abstractmethod
    def _send_notification(self, peer: str, tag: bytes) -> None:
        """Send a standalone tag to a known peer."""

    @abc.abstractmethod
    def _on_close(self) -> None:
        """Free what __init__ acquired (agent, listener). Runs after deregister()."""

    # -- KVTransferBackend -----------------------------------------------------------------------

    @property
    def agent_name(self) -> str:
        return self._agent_name

    @property
    def registered_layout(self) -> KVLayout | None:
        return self._layout

    def register(self, layout: KVLayout) -> None:
        self._check_open()
        if self._layout is not None:
            raise KVTransferError(f"{self._agent_name}: a layout is already registered; deregister() first")
        self._on_register(layout)
        self._layout = layout

    def deregister(self) -> None:
        if self._layout is None:
            return
        self._transfers.fail_all("local layout deregistered")
        self._on_deregister()
        self._peers.clear()
        self._layout = None

    def peer_metadata(self) -> bytes:
        layout = self._require_layout()
        return encode_peer_info(self._transport_info(PeerInfo(self.backend_name, self._agent_name, layout)))

    def add_peer(self, metadata: bytes) -> str:
        layout = self._require_layout()
        info = decode_peer_info(metadata, self.backend_name)
        check_compatible(layout, info.name, info.layout)
        if info.name in self._peers:
            self.remove_peer(info.name)
        self._on_add_peer(info)
        self._peers[info.name] = info
        return info.name

    def remove_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is None:
            return
        for transfer_id, handle in list(self._handles.items()):
            if handle.peer == peer:
                self._transfers.fail(transfer_id, f"peer {peer!r} was removed")
        self._on_remove_peer(peer)

    def cut_inbound(self, peer: str) -> bool:
        self._check_open()
        return self._cut_inbound(peer)

    def _cut_inbound(self, peer: str) -> bool:
        return False  # one-sided writes (NIXL): nothing on our side can refuse them

    def describe(self, block_ids: Sequence[int]) -> list[Descriptor]:
        return describe(self._require_layout(), block_ids)

    def write(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
              notif_tag: bytes) -> TransferHandle:
        return self._start(TransferOp.WRITE, peer, local_block_ids, remote_block_ids, notif_tag)

    def read(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
             notif_tag: bytes) -> TransferHandle:
        return self._start(TransferOp.READ, peer, local_block_ids, remote_block_ids, notif_tag)

    def poll(self, handle: TransferHandle) -> TransferStatus:
        status = self._transfers.get(handle.transfer_id)
        if status.state.is_terminal:
            return status
        self._progress(handle)
        return self._transfers.get(handle.transfer_id)

    def abort(self, handle: TransferHandle, reason: str) -> None:
        if self._transfers.fail(handle.transfer_id, reason):
            self._cancel(handle)

    def release(self, handle: TransferHandle) -> None:
        self.abort(handle, "released before completion")
        self._transfers.clear(handle.transfer_id)
        self._handles.pop(handle.transfer_id, None)

    def notifications(self) -> list[Notification]:
        self._check_open()
        return self._drain_notifications()

    def notify(self, peer: str, tag: bytes) -> None:
        self._check_open()
        self._require_peer(peer)
        self._send_notification(peer, tag)

    def close(self) -> None:
        if self._closed:
            return
        self.deregister()
        self._closed = True
        self._on_close()

    def __enter__(self) -> BackendCore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- helpers for subclasses ------------------------------------------------------------------

    def _start(self, op: TransferOp, peer: str, local_block_ids: Sequence[int],
               remote_block_ids: Sequence[int], notif_tag: bytes) -> TransferHandle:
        """Blocks move whole, rank to rank, when both caches split their heads alike; otherwise
        each destination rank gets its heads' slices from the ranks holding them."""
        layout = self._require_layout()
        remote_layout = self._require_peer(peer).layout
        local, remote = check_block_pairs(local_block_ids, remote_block_ids, layout.num_blocks, remote_layout.num_blocks)
        if same_split(layout, remote_layout):
            runs = rank_runs(pair_runs(local, remote), layout.tp_size, layout.num_blocks, remote_layout.num_blocks)
            handle = self._open(op, peer, len(local), len(local) * layout.tp_size * layout.block_size_bytes)
            self._post(handle, runs, bytes(notif_tag))
            return handle
        dst = remote_layout if op is TransferOp.WRITE else layout  # each of its bytes is written once
        handle = self._open(op, peer, len(local), len(local) * dst.tp_size * dst.block_size_bytes)
        self._post_slices(handle, (local, remote), bytes(notif_tag))
        return handle

    def _open(self, op: TransferOp, peer: str, num_blocks: int, num_bytes: int) -> TransferHandle:
        handle = TransferHandle(next(self._ids), peer, op, num_blocks, num_bytes)
        self._transfers.open(handle.transfer_id)
        self._handles[handle.transfer_id] = handle
        return handle

    def _check_open(self) -> None:
        if self._closed:
            raise BackendClosed(f"{self._agent_name} is closed")

    def _require_layout(self) -> KVLayout:
        self._check_open()
        if self._layout is None:
            raise NotRegistered(f"{self._agent_name}: call register(layout) first")
        return self._layout

    def _require_peer(self, peer: str) -> PeerInfo:
        info = self._peers.get(peer)
        if info is None:
            raise PeerUnavailable(f"unknown peer {peer!r}; add_peer(metadata) first")
        return info
