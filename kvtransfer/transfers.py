"""TransferTable: the status of every live transfer, with the state rules in one place.

Rules: states only move forward; SUCCESS and FAILED are terminal (FAILED is sticky); once a key is
cleared, late events for it are dropped, so a late FAILED never recreates a cleared transfer.
Keys are opaque (transfer ids here; the roles may key by bootstrap room). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

from kvtransfer.base import TransferState, TransferStatus, UnknownTransfer


class TransferTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[Hashable, TransferStatus] = {}

    def open(self, key: Hashable, state: TransferState = TransferState.TRANSFERRING) -> None:
        """Start tracking `key` in `state`."""
        with self._lock:
            assert key not in self._status, f"transfer {key!r} opened twice"
            self._status[key] = TransferStatus(state)

    def advance(self, key: Hashable, state: TransferState, reason: str = "") -> bool:
        """Move `key` to `state`; False (and no change) when the key is cleared or the step is illegal."""
        assert state is not TransferState.FAILED or reason, "a FAILED transfer needs a reason"
        with self._lock:
            current = self._status.get(key)
            if current is None or not current.state.can_become(state):
                return False
            self._status[key] = TransferStatus(state, reason)
            return True

    def fail(self, key: Hashable, reason: str) -> bool:
        """advance(key, FAILED, reason)."""
        return self.advance(key, TransferState.FAILED, reason)

    def get(self, key: Hashable) -> TransferStatus:
        """The status of `key`; UnknownTransfer once cleared."""
        with self._lock:
            status = self._status.get(key)
        if status is None:
            raise UnknownTransfer(f"transfer {key!r} is unknown or was released")
        return status

    def clear(self, key: Hashable) -> TransferStatus | None:
        """Stop tracking `key`; returns its last status (None if it was not tracked)."""
        with self._lock:
            return self._status.pop(key, None)

    def live_keys(self) -> list[Hashable]:
        """Keys whose state is not terminal yet."""
        with self._lock:
            return [key for key, status in self._status.items() if not status.state.is_terminal]

    def fail_all(self, reason: str) -> list[Hashable]:
        """Fail every live key; returns the keys that changed."""
        return [key for key in self.live_keys() if self.fail(key, reason)]

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._status

    def __len__(self) -> int:
        with self._lock:
            return len(self._status)
