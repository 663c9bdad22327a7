"""The life of one KV transfer, shared by the transfer backends and the control plane."""

from __future__ import annotations

import enum


class TransferState(enum.Enum):
    """Only moves forward; SUCCESS and FAILED are terminal, FAILED is sticky."""

    BOOTSTRAPPING = 0  # waiting for the peer's metadata / handshake
    WAITING_FOR_INPUT = 1  # peer known, waiting for the blocks to send (or to receive into)
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def is_terminal(self) -> bool:
        """True for SUCCESS and FAILED."""
        return self in (TransferState.SUCCESS, TransferState.FAILED)

    def can_become(self, new: TransferState) -> bool:
        """True when `self -> new` is a legal step: forward only, nothing after a terminal state."""
        return not self.is_terminal and new.value > self.value
