"""Decode side of the pull flow (vLLM's NixlConnector protocol): read the prompt's KV from the
prefill worker a ticket names, then compute the last prompt token here.

The ticket is the prefill's `kv_transfer_params`: `remote_engine_id` (the prefill worker's transfer
agent), `remote_host`/`remote_port` (its control address), `remote_block_ids`, `remote_request_id`.
Steps, each bounded by the request's deadline: as soon as the request arrives, connect (or reuse the
stream), check the engine and claim the lease (held while the request waits for room in our KV
cache); then READ the blocks that hold every prompt token but the last, and release the lease. Only a
release answered `ok` (the blocks stayed leased through the read) makes the read KV the request's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from decode.peers import PrefillPeers
from decode.waiting import Fences, PendingKV
from disagg.pd_config import DisaggConfig
from disagg.engine.core import EngineCore
from disagg.engine.progress import Reservation
from disagg.types import InvalidRequest
from disagg.wire.auth import format_address
from disagg.wire.control_msgs import LeaseStatusMsg, TransferState, TransferStatusMsg
from disagg.wire.engine_msgs import GenerateMsg
from kvtransfer.base import KVTransferBackend, TransferFailed

log = structlog.get_logger(__name__)

TICKET_FIELDS = (("remote_engine_id", str), ("remote_host", str), ("remote_port", int),
                 ("remote_request_id", str), ("remote_block_ids", list))


@dataclass(frozen=True)
class Ticket:
    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    num_cached_tokens: int = 0  # the prompt tokens the prefill found cached (`remote_num_cached_tokens`)


def carries_ticket(msg: GenerateMsg) -> bool:
    """The request names a prefill to read from (`kv_transfer_params.do_remote_prefill`)."""
    params = msg.kv_transfer_params
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


def ticket_of(msg: GenerateMsg) -> Ticket | None:
    """The prefill's ticket on a decode request (None: a push-flow request); InvalidRequest when
    `do_remote_prefill` is set but a field is missing or of the wrong type."""
    if not carries_ticket(msg):
        return None
    params = msg.kv_transfer_params
    bad = [name for name, kind in TICKET_FIELDS
           if not isinstance(params.get(name), kind) or isinstance(params.get(name), bool)]
    ids = params.get("remote_block_ids")
    if isinstance(ids, list) and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        bad.append("remote_block_ids")
    if bad:
        raise InvalidRequest(f"kv_transfer_params with do_remote_prefill needs {', '.join(sorted(set(bad)))} "
                             "as the prefill returned them", "kv_transfer_params")
    cached = params.get("remote_num_cached_tokens")
    cached = cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else 0
    return Ticket(params["remote_engine_id"], params["remote_host"], params["remote_port"],
                  params["remote_request_id"], tuple(ids), cached)


async def wait_read(backend: KVTransferBackend, handle, deadline: float) -> None:
    """Poll a READ until it ends (backing off to 1 ms); TransferFailed when it fails or times out."""
    delay_s = 50e-6
    while True:
        status = backend.poll(handle)
        if status.state is TransferState.SUCCESS:
            return
        if status.state is TransferState.FAILED:
            raise TransferFailed(f"reading the KV from the prefill failed: {status.reason}")
        if time.monotonic() > deadline:
            backend.abort(handle, "read deadline passed")
            raise TransferFailed("reading the KV from the prefill did not finish before the deadline")
        await asyncio.sleep(delay_s)
        delay_s = min(delay_s * 2, 1e-3)


def check_engine(ticket: Ticket, prefill_name: str) -> None:
    if prefill_name != ticket.engine_id:
        raise InvalidRequest(f"the ticket names prefill engine {ticket.engine_id!r}, but {ticket.host}:{ticket.port} "
                             f"is {prefill_name!r} now (it restarted, or the ticket is not from this cluster)",
                             "kv_transfer_params")


class PullFetch:
    def __init__(self, core: EngineCore, config: DisaggConfig, backend: KVTransferBackend, peers: PrefillPeers,
                 fences: Fences):
        self.core, self.config, self.backend, self.peers, self.fences = core, config, backend, peers, fences
        self._read_peers: dict[str, tuple] = {}  # prefill agent -> (its ControlClient, backend peer)

    def check(self, msg: GenerateMsg, ticket: Ticket) -> None:
        """Refuse, before any connection, what the pull flow cannot serve."""
        if msg.sampling.prompt_logprobs is not None:
            raise InvalidRequest("prompt logprobs are not available in the pull flow (kv_transfer_params): "
                                 "the decode reads the prompt's KV, not its logprobs", "prompt_logprobs")
        if not self.config.decode.allows_bootstrap_address(ticket.host, ticket.port):
            address = format_address(ticket.host, ticket.port)
            raise InvalidRequest(f"kv_transfer_params remote_host:remote_port {address!r} is not allowed on this "
                                 "decode server (see its --allowed-bootstrap-hosts)", "kv_transfer_params")

    def hold(self, pending: PendingKV) -> None:
        """Claim the ticket's lease as soon as the request arrives, before it waits for room in our KV
        cache: a claimed lease lives as long as our control stream (its heartbeats keep it), so a
        request that queues longer than the prefill's lease still finds its blocks."""
        pending.hold = asyncio.create_task(self._claim(pending, time.monotonic() + self.config.decode.waiting_timeout_s))
        pending.hold.add_done_callback(lambda task: task.cancelled() or task.exception())  # fetch() reads it; an abort may not

    async def _claim(self, pending: PendingKV, deadline: float) -> LeaseStatusMsg:
        ticket = pending.ticket
        client = await asyncio.wait_for(self.peers.client_at(ticket.host, ticket.port), max(deadline - time.monotonic(), 1e-3))
        check_engine(ticket, client.remote.peer_name)
        pending.lease = (client, ticket.request_id)
        claim = await client.claim(ticket.request_id)
        if not claim.ok:
            raise TransferFailed(f"prefill {ticket.host}:{ticket.port} refused the claim of {ticket.request_id}: {claim.reason}",
                                 peer_lost=claim.peer_lost)
        return claim

    async def fetch(self, pending: PendingKV, reservation: Reservation, deadline: float) -> TransferStatusMsg:
        """Read the KV of every prompt token but the last from the ticket's prefill, once our claim
        holds; the blocks of our own cached prefix are not read."""
        ticket = pending.ticket
        claim = await pending.hold
        client = pending.lease[0]
        prefill = await self._read_peer(client)
        blocks, first = reservation.block_ids, reservation.num_cached_blocks
        num_blocks = -(-(reservation.num_prompt_tokens - 1) // self.core.block_size)
        end = min(num_blocks, len(claim.block_ids), len(blocks))
        num_bytes = 0
        if end > first:
            pending.read_peer = prefill
            pending.read = self.backend.read(prefill, blocks[first:end], list(claim.block_ids[first:end]),
                                             f"pull:{ticket.request_id}".encode())
            num_bytes, started = pending.read.num_bytes, time.monotonic()
            await wait_read(self.backend, pending.read, deadline)
            pending.read, pending.read_s = None, time.monotonic() - started
        pending.lease = None
        checked = self.config.kv_checksum and end > first  # the prefill digests what we read
        pending.dst_block_ids = tuple(blocks[first:end]) if checked else ()
        released = await client.release(ticket.request_id, digest_blocks=(first, end - first) if checked else (0, 0))
        if not released.ok:
            raise TransferFailed(f"the KV of {ticket.request_id} was not held through the read: {released.reason}",
                                 peer_lost=released.peer_lost)
        return TransferStatusMsg(room=0, state=TransferState.SUCCESS, num_bytes=num_bytes, kv_digest=released.kv_digest)

    def admit(self, request_id: str, pending: PendingKV, status: TransferStatusMsg) -> bool:
        """Every prompt token but the last is in our blocks: the last one and the first output are ours."""
        progress = self.core.request_progress(request_id)
        return progress is not None and self.core.admit_remote_prefix(request_id, progress.num_prompt_tokens - 1,
                                                                      pending.ticket.num_cached_tokens)

    async def _read_peer(self, client) -> str:
        """The backend peer to READ from a prefill, added once per incarnation; peers of prefills whose
        stream is gone (lost, restarted under a new name) are removed first, so none piles up."""
        for name, (old, peer) in list(self._read_peers.items()):
            if not old.is_alive:
                del self._read_peers[name]
                await asyncio.to_thread(self.backend.remove_peer, peer)
        entry = self._read_peers.get(client.remote.peer_name)
        if entry is None:  # a tcp connect and handshake: off the loop
            peer = await asyncio.to_thread(self.backend.add_peer, client.remote.agent_metadata)
            entry = self._read_peers[client.remote.peer_name] = (client, peer)
        return entry[1]

    def end(self, request_id: str, pending: PendingKV, reason: str) -> bool:
        """Stop waiting; True when the blocks may go back now. A READ in flight is cut off first; the
        prefill frees its leased blocks now, not at the lease's expiry."""
        if pending.hold is not None:
            pending.hold.cancel()  # a claim in flight is answered before the release that follows it
        reading = pending.read is not None
        if reading:  # our own read is what writes into the blocks
            self.backend.abort(pending.read, reason)
            self.fences.start(f"read:{request_id}", self._cut_read(request_id, pending.read_peer))
        if pending.lease is not None:
            client, remote_request_id = pending.lease
            client.release(remote_request_id, reason)
        else:  # gave up before reaching the prefill
            self.fences.start(f"release:{request_id}", self._release_ticket(pending.ticket, reason))
        return not reading

    async def _cut_read(self, request_id: str, peer: str) -> None:
        """An aborted READ may be mid-copy (cancelling is best effort): drop that prefill's backend
        peer (tcp: close its connection and join its threads) before the blocks go back. Other reads
        from that prefill fail with it; the next one adds the peer again."""
        try:
            for name, (_, known) in list(self._read_peers.items()):
                if known == peer:
                    del self._read_peers[name]
            await asyncio.to_thread(self.backend.remove_peer, peer)
        finally:
            self.fences.fenced(request_id)

    async def _release_ticket(self, ticket: Ticket, reason: str) -> None:
        """Tell a ticket's prefill to free the blocks we will not read (bounded)."""
        try:
            wait_s = self.config.decode.waiting_timeout_s
            client = await asyncio.wait_for(self.peers.client_at(ticket.host, ticket.port), wait_s)
            await asyncio.wait_for(client.release(ticket.request_id, reason), wait_s)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own then
            log.warning("could not release a ticket's lease", request_id=ticket.request_id, error=str(exc))
