"""KV cache block transfer: one request-agnostic interface (kvtransfer.base), several backends.

    from kvtransfer import KVLayout, create_backend, wait
    with create_backend("tcp") as backend:
        backend.register(layout)
        ...

Light on purpose: importing kvtransfer loads neither NIXL nor torch.
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
