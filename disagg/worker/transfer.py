"""What the prefill and decode roles share beyond the unified role: a registered KV cache and a transfer backend.

prefill/role.py and decode/role.py build on `TransferRole`; the unified role knows nothing of it.
"""

from __future__ import annotations

import structlog

from disagg.types import FaultKind
from disagg.worker.unified import UnifiedRole
from kvtransfer.base import KVTransferBackend
from kvtransfer.faulty import FaultyBackend, pause_heartbeats

log = structlog.get_logger(__name__)


class TransferRole(UnifiedRole):
    """A role whose KV cache is registered with a transfer backend and its peers (set in `start()`)."""

    can_sleep = False  # freeing the registered KV cache would break the peers that write or read it
    backend: KVTransferBackend | FaultyBackend

    def faulty(self, backend: KVTransferBackend) -> KVTransferBackend | FaultyBackend:
        """The role's transfer backend, wrapped so that transfer faults reach it when the server allows them."""
        return FaultyBackend(backend) if self.fault_injection else backend

    def inject_fault(self, name: str, params: dict) -> None:
        """A worker-side fault the front checked (disagg/dp/faults.py), by its FaultKind's value: the
        unified role's, or one of the transfer's (on the backend `faulty()` wrapped)."""
        kind = FaultKind(name)
        if kind is FaultKind.SLOW_STEPS:
            return super().inject_fault(name, params)
        if kind is FaultKind.STOP_HEARTBEATS:
            pause_heartbeats(params["seconds"])
        elif kind is FaultKind.DELAY_TRANSFERS:
            self.backend.delay(params["count"], params["seconds"])
        elif kind is FaultKind.CORRUPT_TRANSFERS:
            self.backend.corrupt(params["count"])
        else:
            self.backend.fail(params["count"])
        log.warning("fault injected", fault=kind, **params)
