"""The prefill worker: computes prompts and hands their KV to decodes, in either flow.

The role owns what both flows share: the transfer endpoint, the control server decodes connect to,
the registry registration (refreshed), and the routing of engine outputs and control events to the
flow that owns the request: prefill/push.py (rooms, SGLang's protocol) or prefill/pull.py (leased
tickets, vLLM's protocol).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import msgspec
import structlog

from bootstrap.client import BootstrapClient
from disagg.config import LoadBalanceMethod
from disagg.pd_config import DisaggConfig
from disagg.worker.transfer import TransferRole
from disagg.engine.core import EngineCore
from disagg.types import RequestOutput, SamplingParams
from disagg.wire.bootstrap_msgs import RankRegistrationMsg
from disagg.wire.control_msgs import AbortMsg, LeaseMsg, PeerLostMsg, PeerMsg, TransferInfoMsg
from disagg.wire.engine_msgs import DecodeKey, GenerateMsg, OutputMsg, PdStatsMsg, StatsMsg
from kvtransfer.checksum import kv_digest
from kvtransfer.control.endpoint import open_endpoint
from kvtransfer.control.server import ControlServer
from prefill.pull import PullRequests, is_pull
from prefill.push import PushRooms
from prefill.rooms import RoomState

log = structlog.get_logger(__name__)
BUSY_WAIT_S = 0.002


def one_token(params: SamplingParams) -> SamplingParams:
    """A prefill computes the first token only; it obeys min_tokens as it would in one engine (no
    EOS or stop id first)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


class PrefillRole(TransferRole):
    def __init__(self, core: EngineCore, dp_rank: int, model_name: str, *, config: DisaggConfig, dp_size: int,
                 load_balance_method: LoadBalanceMethod):
        super().__init__(core, dp_rank, model_name)
        self.config = config
        self.dp_size = dp_size
        self.load_balance_method = load_balance_method
        self.pull = PullRequests(core, config.prefill.kv_lease_s)

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        secret = self.config.cluster_secret
        self.backend, local = open_endpoint("prefill", self.dp_rank, self.config.transfer_backend, self.config.rank_host,
                                            dataclasses.asdict(self.core.cache_spec()), secret,
                                            self.config.tcp_listener)
        self.backend = self.faulty(self.backend)
        # A control event (a claim, a release, a TransferInfo) ends the worker's idle wait at once.
        self.control = ControlServer(local, self.config.control, cluster_secret=secret, on_event=lambda: self.wake())
        port = await self.control.start(self.config.rank_host, 0)
        registry = self.config.prefill
        self.bootstrap = BootstrapClient(registry.bootstrap_host, registry.bootstrap_port, cluster_secret=secret,
                                         identity=self.backend.agent_name)
        self.push = PushRooms(self.core, self.dp_rank, self.config, self.backend, self.control, self.bootstrap.register_dp_rank)
        self.registration = RankRegistrationMsg(
            dp_rank=self.dp_rank, dp_size=self.dp_size, rank_ip=self.config.rank_host, rank_port=port,
            tp_size=local.layout.tp_size, page_size=local.layout.block_size_tokens, kv_cache_dtype=local.layout.dtype,
            load_balance_method=self.load_balance_method, transfer_backend=self.config.transfer_backend,
            agent_name=self.backend.agent_name,
        )
        await self._register()
        # Pull flow: what a decode needs to reach this worker and read from it (vLLM's field names).
        self.ticket = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.backend.agent_name,
                       "remote_host": self.config.rank_host, "remote_port": port, "tp_size": local.layout.tp_size}
        self.refresher = asyncio.create_task(self._refresh_registration())
        log.info("prefill rank registered", control_port=port, backend=self.config.transfer_backend)

    async def _refresh_registration(self) -> None:
        """Register again every `registry_refresh_s`: a registry that restarted (and forgot the
        ranks) knows the topology again within that period."""
        interval_s = self.config.prefill.registry_refresh_s
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._register(deadline_s=interval_s)
            except Exception as exc:  # noqa: BLE001 - the registry may be down for a while: try again later
                log.warning("registry refresh failed", error=f"{type(exc).__name__}: {exc}")

    async def _register(self, **kwargs) -> None:
        """Every TP rank of this worker's group, each at this endpoint: rank 0 moves the group's KV
        (its layout names each rank's heads), so the registry's topology carries the TP size."""
        for tp_rank in range(self.registration.tp_size):
            await self.bootstrap.register_rank(msgspec.structs.replace(self.registration, tp_rank=tp_rank), **kwargs)

    async def close(self) -> None:
        self.refresher.cancel()
        await self.control.close()
        await self.bootstrap.close()
        self.backend.close()

    def stats(self) -> StatsMsg:
        """The engine's figures, the leases of issued tickets (a drain waits for them) and the P/D
        queues: rooms waiting for their decode's destination, rooms computed whose KV goes out."""
        rooms, leases = self.push.book.running.values(), len(self.pull.leases.leases)
        pd = PdStatsMsg(prefill_bootstrap=sum(r.state is RoomState.WAITING for r in rooms),
                        prefill_inflight=sum(r.state is RoomState.SENDING and r.computed_at is not None for r in rooms)
                        + leases, num_bootstrap_failed=self.push.num_failed[0], num_transfer_failed=self.push.num_failed[1])
        return msgspec.structs.replace(super().stats(), num_leases=leases, pd=pd)

    def holding(self) -> str | None:
        """The engine's requests, then the rooms still running here, then the leases of issued tickets."""
        if (held := super().holding()) is not None:
            return held
        if self.push.book.running:
            return f"{len(self.push.book.running)} bootstrap rooms"
        return f"{len(self.pull.leases.leases)} KV leases" if self.pull.leases.leases else None

    def idle_wait_s(self, default_s: float) -> float:
        return BUSY_WAIT_S if self.push.busy else default_s

    # ---- requests -----------------------------------------------------------------------------

    async def submit(self, msg: GenerateMsg) -> list[OutputMsg]:
        if is_pull(msg):
            return self.pull.submit(msg, self.prompt_ids, one_token(msg.sampling))
        return await self.push.submit(msg, self.prompt_ids, one_token(msg.sampling))

    async def abort(self, request_id: str) -> list[OutputMsg]:
        if self.pull.abort(request_id):
            return self._convert(self.core.take_outputs())
        out = self.push.abort(request_id)
        return await super().abort(request_id) if out is None else out

    async def room_failed(self, room: int, reason: str, decode: DecodeKey | None = None) -> list[OutputMsg]:
        return await self.push.room_failed(room, reason, decode)

    def room_placed(self, room: int, dp_rank: int) -> list:
        return self.push.room_placed(room, dp_rank)

    def _convert(self, outputs: list[RequestOutput]) -> list[OutputMsg]:
        """Answers of P/D requests are held by their flow until their KV is delivered (this may run
        in the engine-step thread: the flows only record there, and act in poll())."""
        return [msg for out, msg in zip(outputs, super()._convert(outputs))
                if not self.pull.hold(msg) and not self.push.take(out, msg)]

    # ---- background: control events and transfers --------------------------------------------

    async def poll(self) -> list[OutputMsg]:
        out: list[OutputMsg] = []
        self.backend.notifications()  # push flow tracks completion by handle: drop tags, never let them pile up
        while not self.control.events.empty():
            event = self.control.events.get_nowait()
            if isinstance(event, PeerMsg):
                await self.push.add_peer(event)
            else:
                out += self._on_event(event)
        now = time.monotonic()
        return out + self.push.advance(now) + self.pull.answer(now, self.ticket)

    def _on_event(self, event) -> list[OutputMsg]:
        if isinstance(event, TransferInfoMsg):
            return self.push.on_transfer_info(event)
        if isinstance(event, AbortMsg):
            return self.push.on_decode_abort(event.room, event.reason)
        if isinstance(event, LeaseMsg):
            digest = (lambda ids: kv_digest(self.backend.registered_layout, ids)) if self.config.kv_checksum else None
            self.control.send_lease(event.peer_name, self.pull.on_lease(event, digest))
        elif isinstance(event, PeerLostMsg):
            self.pull.on_peer_lost(event.peer_name)
            return self.push.on_peer_lost(event.peer_name, event.rooms, event.reason)
        return []
