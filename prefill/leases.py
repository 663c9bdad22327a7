"""Pull flow (vLLM's kv_transfer_params): the prefill's finished requests whose blocks a decode will
read. Pure Python; the prefill role applies the answers to the engine and the control plane.

A lease starts when the prefill answers with its ticket and expires after `lease_s` unless a decode
claims it; a claimed lease lasts until that decode releases it or its stream ends (its heartbeats
keep it). Blocks go back to the pool only when the lease ends, so a decode never reads reused blocks
while its claim holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Lease:
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float
    claimed_by: str | None = None  # the decode peer reading the blocks


@dataclass(frozen=True)
class LeaseAnswer:
    ok: bool
    reason: str = ""
    block_ids: tuple[int, ...] = ()
    ended: bool = False  # the lease is gone: free its blocks


class LeaseTable:
    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.leases: dict[str, Lease] = {}

    def grant(self, request_id: str, block_ids: list[int], now: float) -> Lease:
        assert request_id not in self.leases, f"lease {request_id} granted twice"
        lease = self.leases[request_id] = Lease(request_id, tuple(block_ids), now + self.lease_s)
        return lease

    def claim(self, request_id: str, peer: str) -> LeaseAnswer:
        lease = self.leases.get(request_id)
        if lease is None:
            return LeaseAnswer(False, f"no blocks are leased for {request_id} (expired, released or never granted)")
        if lease.claimed_by not in (None, peer):
            return LeaseAnswer(False, f"the blocks of {request_id} are claimed by decode {lease.claimed_by}")
        lease.claimed_by = peer
        return LeaseAnswer(True, block_ids=lease.block_ids)

    def release(self, request_id: str, peer: str) -> LeaseAnswer:
        """End the lease. `ok`: the blocks stayed held by `peer`'s claim until now."""
        lease = self.leases.get(request_id)
        if lease is None:
            return LeaseAnswer(False, f"no blocks are leased for {request_id} (expired, released or never granted)")
        if lease.claimed_by not in (None, peer):
            return LeaseAnswer(False, f"the blocks of {request_id} are claimed by decode {lease.claimed_by}")
        del self.leases[request_id]
        if lease.claimed_by is None:
            return LeaseAnswer(False, f"{request_id} was released without a claim", ended=True)
        return LeaseAnswer(True, ended=True)

    def expire(self, now: float) -> list[str]:
        """Unclaimed leases past their expiry, removed."""
        gone = [rid for rid, lease in self.leases.items() if lease.claimed_by is None and now > lease.expires_at]
        for rid in gone:
            del self.leases[rid]
        return gone

    def drop_peer(self, peer: str) -> list[str]:
        """Leases claimed by a decode whose stream ended, removed."""
        gone = [rid for rid, lease in self.leases.items() if lease.claimed_by == peer]
        for rid in gone:
            del self.leases[rid]
        return gone
