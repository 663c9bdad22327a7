"""--kv-checksum on a decode: the KV that lands for a request, digested a piece at a time as the
prefill's tags say each landed (`room:R:start:end`, offsets into the blocks the decode gave), then
checked against the prefill's digest before the request's first token (kvtransfer/checksum.py)."""

from __future__ import annotations

from collections.abc import Iterable

from decode.waiting import PendingKV
from disagg.wire.control_msgs import TransferStatusMsg
from kvtransfer.base import Notification
from kvtransfer.checksum import ChecksumMismatch, LandedDigest, flip_byte, kv_digest, piece_of


class KVChecks:
    def __init__(self, backend):
        self.backend = backend

    def digest_landed(self, notes: Iterable[Notification], pending: Iterable[PendingKV]) -> None:
        """Digest the pieces the tags say landed, of the push requests whose KV is on its way."""
        rooms = {p.room: p for p in pending if p.ticket is None and p.dst_block_ids}
        for note in notes:
            piece = piece_of(note.tag)
            if piece is not None and (found := rooms.get(piece[0])) is not None:
                self.landed(found).landed(piece[1], piece[2])

    def landed(self, pending: PendingKV) -> LandedDigest:
        """The request's digest of what landed; the corrupt_transfers fault flips a byte of its first
        block just before that block is read (it has landed by then)."""
        if pending.landed is None or pending.landed.block_ids != pending.dst_block_ids:
            layout, first = self.backend.registered_layout, pending.dst_block_ids[0]
            corrupt = getattr(self.backend, "take_corruption", lambda: False)()
            pending.landed = LandedDigest(layout, pending.dst_block_ids,
                                          before_first=(lambda: flip_byte(layout, first)) if corrupt else None)
        return pending.landed

    def check(self, pending: PendingKV, status: TransferStatusMsg) -> ChecksumMismatch | None:
        """What landed (push) or what we read (pull) against the prefill's digest of the same blocks (TP
        sizes may differ: the digest reads blocks as a TP-1 cache holds them). Pieces digested as they
        landed count; a mismatch is read again whole before it fails the request (a piece written twice)."""
        digest = self.landed(pending)
        what = f"bootstrap_room {pending.room}" if pending.ticket is None else f"the KV of {pending.ticket.request_id}"
        if not status.kv_digest:
            return ChecksumMismatch(f"{what}: the prefill sent no KV checksum (start it with --kv-checksum too)")
        early, landed = digest.num_digested, digest.value()
        if landed != status.kv_digest and early:
            landed = kv_digest(self.backend.registered_layout, pending.dst_block_ids)
        if landed == status.kv_digest:
            return None
        return ChecksumMismatch(f"KV checksum mismatch for {what}: the prefill wrote {status.kv_digest:016x}, the "
                                f"{len(pending.dst_block_ids)} blocks that landed digest to {landed:016x}")
