"""Prefill side of the pull flow (vLLM's NixlConnector protocol, `kv_transfer_params`).

A request with `kv_transfer_params.do_remote_decode` is computed with `hold_blocks`; its one-token
answer carries a ticket (`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`,
`remote_host`, `remote_port`, `remote_request_id`, `tp_size`) and its blocks stay leased until the
decode that read them releases them, the lease expires unclaimed, or the claiming decode is lost.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import structlog

from disagg.worker.outputs import error_output
from disagg.engine.core import EngineCore
from disagg.types import SamplingParams
from disagg.wire.control_msgs import LeaseMsg, LeaseStatusMsg
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg
from prefill.leases import LeaseTable

log = structlog.get_logger(__name__)


def is_pull(msg: GenerateMsg) -> bool:
    """A pull-flow prefill request: vLLM's router asks for a remote decode."""
    params = msg.kv_transfer_params
    return isinstance(params, dict) and params.get("do_remote_decode") is True


class PullRequests:
    def __init__(self, core: EngineCore, lease_s: float):
        self.core = core
        self.leases = LeaseTable(lease_s)
        self.finals: dict[str, OutputMsg | None] = {}  # computing (None) or finished, not answered yet

    def submit(self, msg: GenerateMsg, prompt_ids: Callable[[GenerateMsg], list[int]], params: SamplingParams) -> list[OutputMsg]:
        """Compute a pull request's prompt, holding its blocks for the ticket."""
        try:
            self.core.add_request(msg.request_id, prompt_ids(msg), params, hold_blocks=True, priority=msg.priority)
        except Exception as exc:  # noqa: BLE001 - one request's input never stops the worker
            return [error_output(msg.request_id, exc)]
        self.finals[msg.request_id] = None
        return []

    def hold(self, msg: OutputMsg) -> bool:
        """Keep a pull request's output until its ticket is ready (may run in the engine-step thread)."""
        if msg.request_id not in self.finals:
            return False
        if msg.finish_reason is not None or msg.error is not None:
            self.finals[msg.request_id] = msg
        return True

    def answer(self, now: float, ticket: dict) -> list[OutputMsg]:
        """Finished requests' answers: with their ticket (and a lease) when they succeeded."""
        out = []
        for request_id, final in list(self.finals.items()):
            if final is None:
                continue
            del self.finals[request_id]
            progress = self.core.request_progress(request_id)
            if final.error is not None or progress is None:
                out.append(final)
                continue
            self.leases.grant(request_id, progress.block_ids, now)
            # remote_num_cached_tokens: ours, not vLLM's (its decodes ignore it): the decode reports it as cached
            params = dict(ticket, remote_block_ids=list(progress.block_ids), remote_request_id=request_id,
                          remote_num_cached_tokens=final.num_cached_tokens)
            out.append(msgspec.structs.replace(final, kv_transfer_params=params))
        for request_id in self.leases.expire(now):
            log.warning("kv lease expired unclaimed", request_id=request_id, lease_s=self.leases.lease_s)
            self.core.release(request_id)
        return out

    def on_lease(self, event: LeaseMsg, digest: Callable[[list[int]], int] | None = None) -> LeaseStatusMsg:
        """A decode claims or releases leased blocks. A release that asks for a digest of the blocks it
        read gets one from `digest` (--kv-checksum), taken before the blocks are freed."""
        first, count = event.digest_blocks
        lease = self.leases.leases.get(event.request_id)
        read = [] if lease is None or digest is None or not event.release else list(lease.block_ids[first:first + count])
        if event.release:
            answer = self.leases.release(event.request_id, event.peer_name)
        else:
            answer = self.leases.claim(event.request_id, event.peer_name)
        kv_digest = digest(read) if read and answer.ok else 0
        if answer.ended:
            self.core.release(event.request_id)
        return LeaseStatusMsg(request_id=event.request_id, ok=answer.ok, reason=answer.reason,
                              block_ids=answer.block_ids, released=event.release, kv_digest=kv_digest)

    def on_peer_lost(self, peer_name: str) -> None:
        for request_id in self.leases.drop_peer(peer_name):
            self.core.release(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a pull request still computing (a leased one is the decode's to release)."""
        if request_id not in self.finals:
            return False
        del self.finals[request_id]
        self.core.abort(request_id)
        return True
