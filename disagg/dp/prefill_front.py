"""The prefill server's DP controller: room planning before dispatch, failures told to every worker."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import msgspec
import structlog

from disagg.config import DisaggregationMode, ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.engine_config import EngineConfig
from disagg.kv_events_config import KVEventsConfig
from disagg.dp.controller import DPController
from disagg.dp.role_switch import PdRoles
from disagg.worker.roles import RoleSpec
from disagg.types import FinishReason
from disagg.wire.engine_msgs import DecodeKey, GenerateMsg, OutputMsg, RoomFailedMsg, RoomMisroutedMsg, RoomPlacedMsg, Utility
from disagg.rank_rule import implied_rank, plan_room

log = structlog.get_logger(__name__)
LEASE_POLL_S = 0.05
LEASE_COUNT_TIMEOUT_S = 2.0  # one count of the leases; settle's deadline caps it


class PrefillController(DPController):
    """The prefill's front: each request's bootstrap room planned (the rank rule), its leases counted
    at a drain. A server that may switch roles (`--enable-pd-role-switch`) runs this front in both
    modes: as a decode it serves as the plain front does."""

    def __init__(self, server: ServerConfig, engine: EngineConfig, role: RoleSpec, disagg: DisaggConfig,
                 kv_events: KVEventsConfig = KVEventsConfig(), pd_roles: PdRoles | None = None):
        super().__init__(server, engine, role, kv_events, pd_roles)
        self.disagg = disagg

    async def generate(self, msg: GenerateMsg, dp_rank: int) -> AsyncIterator[OutputMsg]:
        if self.mode is not DisaggregationMode.PREFILL:  # switched to decode (--enable-pd-role-switch)
            async for out in super().generate(msg, dp_rank):
                yield out
            return
        room = msg.bootstrap_room
        implied_alive = room is None or self.workers[implied_rank(room, self.dp_size)].available
        plan = plan_room(dp_size=self.dp_size, method=self.load_balance_method, dp_rank=dp_rank, room=room,
                         decode_told=msg.disagg_prefill_dp_rank is not None,
                         force_query=self.disagg.force_query_prefill_dp_rank, implied_alive=implied_alive)
        if plan.conflict is not None:
            self.broadcast_room_failure(msg.bootstrap_room, plan.conflict)
            yield OutputMsg(msg.request_id, finish_reason=FinishReason.ABORT, error=plan.conflict, error_status=400, error_param="routed_dp_rank")
            return
        if msg.bootstrap_room is not None and self.dp_size > 1:
            self.announce_room(msg.bootstrap_room, dp_rank)
        async for out in super().generate(msgspec.structs.replace(msg, register_room=plan.register), dp_rank):
            yield out

    async def settle(self, timeout_s: float, hurry: asyncio.Event | None = None) -> int:
        """Keep serving the reads of tickets already issued until no worker holds a lease (released,
        expired or its decode lost), `timeout_s` passed or `hurry` is set; how many were left."""
        deadline = time.monotonic() + timeout_s
        left = 0  # the last count a worker gave; an unanswered count is not a settled drain
        while True:
            count_timeout_s = min(LEASE_COUNT_TIMEOUT_S, max(deadline - time.monotonic(), 0.01))
            counted = await self.num_leases(count_timeout_s)
            left = left if counted is None else counted
            if counted == 0 or time.monotonic() >= deadline or (hurry is not None and hurry.is_set()):
                return left
            await asyncio.sleep(min(LEASE_POLL_S, max(deadline - time.monotonic(), 0.0)))

    async def num_leases(self, timeout_s: float = LEASE_COUNT_TIMEOUT_S) -> int | None:
        """Leases held by the live workers (a dead worker's went with it); None when one did not answer
        in `timeout_s` (busy in a long step, say): the caller asks again."""
        ranks = [w.rank for w in self.workers if w.available]
        if not ranks:
            return 0
        try:
            stats = await self.call_utility(Utility.STATS, ranks=ranks, timeout_s=timeout_s)
        except Exception as exc:  # noqa: BLE001 - a drain never fails on a worker that stopped answering
            log.warning("could not count the leases", error=f"{type(exc).__name__}: {exc}")
            return None
        return sum(s.num_leases for s in stats)

    def announce_room(self, room: int, dp_rank: int) -> None:
        """Every other worker learns where the room went, so a decode told the wrong rank (its
        disagg_prefill_dp_rank) is answered at once instead of at its bootstrap deadline."""
        for worker in self.workers:
            if worker.rank != dp_rank and worker.alive and worker.writer is not None:
                worker.send(RoomPlacedMsg(room, dp_rank))

    def _on_message(self, worker, msg) -> None:
        if isinstance(msg, RoomMisroutedMsg):  # the rank holding the room stops waiting for its decode
            self.broadcast_room_failure(msg.bootstrap_room, msg.reason, msg.decode)
        else:
            super()._on_message(worker, msg)

    def broadcast_room_failure(self, room: int, reason: str, decode: DecodeKey | None = None) -> None:
        """Whichever worker the decode asks about this room answers with the failure at once."""
        for worker in self.workers:
            if worker.alive and worker.writer is not None:
                worker.send(RoomFailedMsg(room, reason, decode))
