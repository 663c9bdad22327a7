"""KV cache block transfer: one request-agnostic interface (kvtransfer.base), several backends.

    from kvtransfer import KVLayout, create_backend, wait
    with create_backend("tcp") as backend:
        backend.register(layout)
        ...

Backends: nixl.py (NIXL agents over UCX), tcp/ (plain sockets and threads), loopback.py (in-process);
the machinery they share: core.py (BackendCore), handshake.py (PeerInfo), transfers.py (TransferTable),
descriptors.py; factory.py picks one by name. They know layouts, block ids, peers and opaque tags,
never a request.

kvtransfer.control is the P/D control plane over gRPC (rooms, leases, heartbeats, request ids) that
the roles drive the backends with: it imports the backends' interface, no backend imports it.

Light on purpose: importing kvtransfer loads neither NIXL nor torch (nor grpc: the control plane
loads only when kvtransfer.control.* is imported).
"""

from kvtransfer.base import (
    AuthenticationFailed, BackendClosed, BackendUnavailable, IncompatiblePeer, InvalidBlockIds, InvalidLayout, KVLayout, KVTransferBackend,
    KVTransferError, LayoutMismatch, Notification, NotRegistered, PeerUnavailable, TransferFailed, TransferHandle,
    TransferOp, TransferState, TransferStatus, UnknownTransfer, wait, wait_all,
)
from kvtransfer.factory import available_backends, create_backend

__all__ = [
    "AuthenticationFailed", "BackendClosed", "BackendUnavailable", "IncompatiblePeer", "InvalidBlockIds", "InvalidLayout", "KVLayout",
    "KVTransferBackend", "KVTransferError", "LayoutMismatch", "NotRegistered", "Notification", "PeerUnavailable",
    "TransferFailed", "TransferHandle", "TransferOp", "TransferState", "TransferStatus", "UnknownTransfer",
    "available_backends", "create_backend", "wait", "wait_all",
]
