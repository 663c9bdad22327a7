"""Decode side of the pull flow (vLLM's NixlConnector protocol): read the prompt's KV from the
prefill worker a ticket names, then compute the last prompt token here.

The ticket is the prefill's `kv_transfer_params`: `remote_engine_id` (the prefill worker's transfer
agent), `remote_host`/`remote_port` (its control address), `remote_block_ids`, `remote_request_id`.
Steps, each bounded by the caller's deadline: connect (or reuse the stream), check the engine, claim
the lease, READ the blocks that hold every prompt token but the last, release the lease. Only a
release answered `ok` (the blocks stayed leased through the read) makes the read KV the request's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from disagg.types import InvalidRequest
from disagg.wire.engine_msgs import GenerateMsg
from kvtransfer import TransferState
from kvtransfer.base import KVTransferBackend, TransferFailed

TICKET_FIELDS = (("remote_engine_id", str), ("remote_host", str), ("remote_port", int),
                 ("remote_request_id", str), ("remote_block_ids", list))


@dataclass(frozen=True)
class Ticket:
    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]


def ticket_of(msg: GenerateMsg) -> Ticket | None:
    """The prefill's ticket on a decode request (None: a push-flow request); InvalidRequest when
    `do_remote_prefill` is set but a field is missing or of the wrong type."""
    params = msg.kv_transfer_params
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    bad = [name for name, kind in TICKET_FIELDS
           if not isinstance(params.get(name), kind) or isinstance(params.get(name), bool)]
    ids = params.get("remote_block_ids")
    if isinstance(ids, list) and not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        bad.append("remote_block_ids")
    if bad:
        raise InvalidRequest(f"kv_transfer_params with do_remote_prefill needs {', '.join(sorted(set(bad)))} "
                             "as the prefill returned them", "kv_transfer_params")
    return Ticket(params["remote_engine_id"], params["remote_host"], params["remote_port"],
                  params["remote_request_id"], tuple(ids))


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
