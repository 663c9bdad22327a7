"""Decode side of the KV control plane: one ControlClient per prefill worker it pulls KV from.

Lifecycle: `connect()` (reach the prefill and register, within `connect_timeout_s`), then
`send_transfer(info)` per room, which returns a future resolved with the room's final
TransferStatusMsg (SUCCESS or FAILED, never an exception), `abort(room)`, and `close()`.
A heartbeat goes out every `heartbeat_interval_s`; after `heartbeat_max_misses` unanswered ones in a
row, or when the stream breaks, every pending room fails with "lost connection to prefill <addr>:
..." and `peer_lost` set (claims and releases too), and the client is dead: make a new one to reconnect.
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import structlog

from disagg.pd_config import ControlConfig
from disagg.wire import kv_control_pb2 as pb
from disagg.wire import kv_control_pb2_grpc as pb_grpc
from disagg.wire.auth import CONTROL, CONTROL_AUTH_KEY, NONCE_BYTES, Binding, answer, reply_matches
from disagg.wire.control_msgs import (
    PeerMsg,
    LeaseStatusMsg,
    TransferInfoMsg,
    TransferState,
    TransferStatusMsg,
    abort_msg,
    claim_msg,
    lease_status_from_pb,
    release_msg,
    heartbeat_msg,
    peer_from_pb,
    register_msg,
    status_from_pb,
    transfer_msg,
)
from kvtransfer.control.server import (
    AuthenticationFailed, Clock, ControlError, PeerRejected, PeerUnavailable, grpc_options,
)
from kvtransfer.faulty import heartbeats_paused

log = structlog.get_logger("kvtransfer.control")


class _Room:
    """A room in flight: its latest status and the future of its final one."""

    def __init__(self, future: asyncio.Future):
        self.future = future
        self.latest: TransferStatusMsg | None = None
        self.fence: asyncio.Future[bool] | None = None  # set by abort(): resolved by the prefill's final status


# Codes of a failed connect attempt that are retried until connect_timeout_s: the stream was torn
# down (INTERNAL, UNKNOWN: seen when the prefill's refusal raced our first write) or not up yet.
RETRYABLE_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE)
CONNECT_RETRY_FIRST_S = 0.05
CONNECT_RETRY_MAX_S = 1.0


class ControlClient:
    """Control-plane stream from this decode worker (`local`) to the prefill worker at `address`."""

    def __init__(self, address: str, local: PeerMsg, config: ControlConfig = ControlConfig(),
                 clock: Clock = time.monotonic, *, cluster_secret: str | None = None):
        self.address = address
        self.local = local
        self.config = config
        self._cluster_secret = cluster_secret
        self.remote: PeerMsg | None = None
        self._clock = clock
        self._channel: grpc.aio.Channel | None = None
        self._call = None
        self._outbox: asyncio.Queue[pb.DecodeMsg | None] = asyncio.Queue()
        self._rooms: dict[int, _Room] = {}
        self._leases: dict[tuple[str, bool], asyncio.Future[LeaseStatusMsg]] = {}  # (request id, release)
        self._tasks: list[asyncio.Task] = []
        self._dead: str | None = "not connected"
        self._lost = False  # _dead says the stream broke (not: never connected, or closed by us)
        self._closing = False
        self._heartbeat_seq = 0
        self._heartbeat_acked = 0
        self.num_heartbeat_misses = 0

    async def __aenter__(self) -> ControlClient:
        if self.remote is None:
            await self.connect()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def _requests(self):
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def connect(self) -> PeerMsg:
        """Reach the prefill worker and register; returns the prefill's PeerMsg.

        PeerUnavailable if it cannot be reached within connect_timeout_s, PeerRejected if it
        refuses our registration (the reason says why, e.g. a page size mismatch), AuthenticationFailed
        if it refuses our cluster secret or, when we hold one, does not prove that it holds it too.
        """
        if self._channel is not None:
            raise ControlError("control client already connected")
        binding, first, reply = await self._open_with_retries()
        await self._check_registration(binding, first, reply)
        self.remote = peer_from_pb(first.register_ack.peer)
        self._dead = None
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._heartbeat_loop())]
        log.info("control stream open", prefill=self.address, peer=self.remote.peer_name)
        return self.remote

    async def _open_with_retries(self):
        """Open the stream, retrying what says nothing about the prefill yet (a stream torn down
        under us) until connect_timeout_s; (what our proof bound, the first reply, the prefill's proof back)."""
        limit_s = self.config.connect_timeout_s
        deadline = self._clock() + limit_s
        backoff_s = CONNECT_RETRY_FIRST_S
        while True:
            try:
                return await self._open_stream(deadline)
            except (asyncio.TimeoutError, grpc.aio.AioRpcError) as exc:
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                if code in RETRYABLE_CODES and self._clock() + backoff_s < deadline:
                    await self._drop_attempt()
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(2 * backoff_s, CONNECT_RETRY_MAX_S)
                    continue
                await self.close()
                if code is grpc.StatusCode.UNAUTHENTICATED:
                    raise AuthenticationFailed(f"prefill {self.address} refused the control stream: {exc.details()}") from None
                detail = "timed out" if code is None else code.name
                raise PeerUnavailable(f"cannot reach prefill {self.address} within {limit_s:g} s ({detail})") from None

    async def _check_registration(self, binding: Binding | None, first, reply: str | None) -> None:
        """The prefill proved the cluster secret (when we hold one) and accepted our registration."""
        if binding is not None and not reply_matches(self._cluster_secret, CONTROL, binding, reply):
            await self.close()
            raise AuthenticationFailed(f"prefill {self.address} did not prove it holds the cluster secret "
                                       "(started without --cluster-secret, or with another one?)")
        if first is grpc.aio.EOF or first.WhichOneof("payload") != "register_ack":
            await self.close()
            raise PeerUnavailable(f"prefill {self.address} did not answer the registration")
        if not first.register_ack.accepted:
            await self.close()
            raise PeerRejected(self.address, first.register_ack.reason)

    async def _open_stream(self, deadline: float) -> tuple[Binding | None, object, str | None]:
        """One attempt: a channel, (with a secret) a challenge and our answer to it, the stream, our
        registration; (what our proof bound, the first reply, the prefill's proof back)."""
        self._channel = grpc.aio.insecure_channel(self.address, options=grpc_options(self.config))
        self._outbox = asyncio.Queue()  # a fresh request stream per attempt
        await asyncio.wait_for(self._connected(), max(deadline - self._clock(), 1e-3))
        stub = pb_grpc.KVControlStub(self._channel)
        binding, metadata = None, None
        if self._cluster_secret is not None:
            challenge = await asyncio.wait_for(stub.Challenge(pb.ChallengeRequest()), max(deadline - self._clock(), 1e-3))
            binding = Binding(challenge.nonce, os.urandom(NONCE_BYTES), self.local.peer_name, self.address)
            metadata = ((CONTROL_AUTH_KEY, answer(self._cluster_secret, CONTROL, binding)),)
        self._call = stub.Connect(self._requests(), metadata=metadata)
        self._outbox.put_nowait(register_msg(self.local))
        first = await asyncio.wait_for(self._call.read(), max(deadline - self._clock(), 1e-3))
        reply = dict(await self._call.initial_metadata() or ()).get(CONTROL_AUTH_KEY)
        return binding, first, reply

    async def _connected(self) -> None:
        """Until the channel is connected; PeerUnavailable at once when its first connection fails
        (refused: no worker listens at the address, e.g. a prefill worker that died, which its registry
        entry still names until the restarted one refreshes it), not at the deadline: gRPC would retry
        with backoff. A connection that hangs (nothing answers) still ends at the deadline."""
        state = self._channel.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                await self.close()
                raise PeerUnavailable(f"cannot reach prefill {self.address}: its connection failed (no worker "
                                      "listens there)")
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=True)

    async def _drop_attempt(self) -> None:
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        await self._channel.close()
        self._channel = self._call = None

    async def close(self) -> None:
        """End the stream; pending rooms fail with "control client closed". Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._fail_all("control client closed", peer_lost=False)
        self._outbox.put_nowait(None)
        reader = self._tasks[0] if self._tasks else None
        if reader is not None:
            # Let the prefill see a clean end of stream before the call is torn down.
            await asyncio.wait([reader], timeout=self.config.close_grace_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._call is not None:
            self._call.cancel()
        if self._channel is not None:
            await self._channel.close()

    @property
    def is_alive(self) -> bool:
        """True while the stream is registered and not lost or closed."""
        return self._dead is None

    @property
    def pending_rooms(self) -> list[int]:
        """Rooms sent and not final yet."""
        return list(self._rooms)

    def status(self, room: int) -> TransferStatusMsg | None:
        """Latest status received for a pending room (None before the first one)."""
        entry = self._rooms.get(room)
        return entry.latest if entry is not None else None

    def send_transfer(self, info: TransferInfoMsg) -> asyncio.Future[TransferStatusMsg]:
        """Send a room's destination blocks; the future resolves with its final status."""
        if self._dead is not None:
            raise PeerUnavailable(f"control stream to prefill {self.address} is down: {self._dead}")
        if info.room in self._rooms:
            raise ControlError(f"room {info.room} already has a transfer in flight to prefill {self.address}")
        future = asyncio.get_running_loop().create_future()
        self._rooms[info.room] = _Room(future)
        self._outbox.put_nowait(transfer_msg(info))
        return future

    def abort(self, room: int, reason: str) -> asyncio.Future[bool]:
        """Give a room up: its future resolves FAILED ("aborted: <reason>") at once, the prefill
        stops writing and frees it. Returns the room's fence: True once no write of the prefill can
        still land in the room's blocks (the prefill's final status for it arrived, or had already);
        False when the stream is lost first (then only cutting that peer off makes the blocks safe)."""
        fence: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry = self._rooms.get(room)
        if entry is None:
            # A live stream already delivered the room's final status: nothing more is written. A
            # dead one may have lost rooms still being written: assume the worst.
            fence.set_result(self._dead is None)
            return fence
        if entry.fence is not None:
            return entry.fence
        entry.fence = fence
        self._resolve(entry, TransferStatusMsg(room=room, state=TransferState.FAILED, reason=f"aborted: {reason}"))
        self._outbox.put_nowait(abort_msg(room, reason))
        return fence

    def claim(self, request_id: str) -> asyncio.Future[LeaseStatusMsg]:
        """Pull flow: hold a finished prefill request's blocks for this stream while we read them.
        Resolves with the prefill's answer (its block ids when ok), or not ok once the stream is lost."""
        return self._lease_call(request_id, False, claim_msg(request_id))

    def release(self, request_id: str, reason: str = "read",
                digest_blocks: tuple[int, int] = (0, 0)) -> asyncio.Future[LeaseStatusMsg]:
        """Pull flow: let the prefill free the blocks. `ok` in the answer: they stayed held by our
        claim until now, so what we read is the request's KV. `digest_blocks` (first, count of the
        leased blocks we read) asks for their digest first (--kv-checksum)."""
        return self._lease_call(request_id, True, release_msg(request_id, reason, digest_blocks))

    def _lease_call(self, request_id: str, release: bool, msg: pb.DecodeMsg) -> asyncio.Future[LeaseStatusMsg]:
        future: asyncio.Future[LeaseStatusMsg] = asyncio.get_running_loop().create_future()
        if self._dead is not None:
            future.set_result(LeaseStatusMsg(request_id=request_id, ok=False, reason=self._dead, released=release,
                                             peer_lost=self._lost))
            return future
        if (request_id, release) in self._leases:
            raise ControlError(f"a {'release' if release else 'claim'} of {request_id} is already in flight")
        self._leases[(request_id, release)] = future
        self._outbox.put_nowait(msg)
        return future

    def drop(self, detail: str) -> None:
        """Declare the prefill lost (e.g. it never acknowledged an abort): every pending room and
        fence fails, the stream ends. Make a new client to reconnect."""
        if self._dead is None and not self._closing:
            self._lose(detail)

    @staticmethod
    def _resolve(entry: _Room, status: TransferStatusMsg) -> None:
        entry.latest = status
        if not entry.future.done():
            entry.future.set_result(status)

    def _fail_all(self, reason: str, peer_lost: bool) -> None:
        if self._dead is None:
            self._dead, self._lost = reason, peer_lost
        rooms, self._rooms = self._rooms, {}
        for room, entry in rooms.items():
            self._resolve(entry, TransferStatusMsg(room=room, state=TransferState.FAILED, reason=reason,
                                                   peer_lost=peer_lost))
            if entry.fence is not None and not entry.fence.done():
                entry.fence.set_result(False)
        leases, self._leases = self._leases, {}
        for (request_id, release), future in leases.items():
            if not future.done():
                future.set_result(LeaseStatusMsg(request_id=request_id, ok=False, reason=reason, released=release,
                                                 peer_lost=peer_lost))

    def _lose(self, detail: str) -> None:
        reason = f"lost connection to prefill {self.address}: {detail}"
        # With nothing in flight (a prefill that drained and stopped) the end of the stream loses nothing.
        busy = bool(self._rooms or self._leases)
        (log.warning if busy else log.info)("control stream lost" if busy else "control stream closed",
                                            prefill=self.address, detail=detail, rooms=len(self._rooms))
        self._fail_all(reason, peer_lost=True)
        self._outbox.put_nowait(None)
        if self._call is not None:
            self._call.cancel()

    async def _read_loop(self) -> None:
        detail = "stream closed by the prefill"
        try:
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                self._on_message(msg)
        except grpc.aio.AioRpcError as exc:
            detail = f"stream failed ({exc.code().name})"
        except asyncio.CancelledError:
            if self._closing or self._dead is not None:
                raise
            detail = "stream cancelled"
        if not self._closing and self._dead is None:
            self._lose(detail)

    def _on_message(self, msg: pb.PrefillMsg) -> None:
        kind = msg.WhichOneof("payload")
        if kind == "status":
            status = status_from_pb(msg.status)
            entry = self._rooms.get(status.room)
            if entry is None:
                return  # aborted or unknown here: a late status changes nothing
            entry.latest = status
            if status.state.is_terminal:
                del self._rooms[status.room]
                self._resolve(entry, status)
                if entry.fence is not None and not entry.fence.done():
                    entry.fence.set_result(True)
        elif kind == "lease_status":
            status = lease_status_from_pb(msg.lease_status)
            future = self._leases.pop((status.request_id, status.released), None)
            if future is not None and not future.done():
                future.set_result(status)
        elif kind == "heartbeat_ack":
            if msg.heartbeat_ack.seq > self._heartbeat_acked:
                self._heartbeat_acked = msg.heartbeat_ack.seq
                self.num_heartbeat_misses = 0
        else:
            log.warning("unexpected control message ignored", prefill=self.address, kind=kind)

    async def _heartbeat_loop(self) -> None:
        max_misses = self.config.heartbeat_max_misses
        while self._dead is None:
            if self._heartbeat_acked < self._heartbeat_seq:
                self.num_heartbeat_misses += 1
                if self.num_heartbeat_misses >= max_misses:
                    self._lose(f"{self.num_heartbeat_misses} heartbeats missed")
                    return
            if not heartbeats_paused():  # fault injection (kvtransfer/faulty.py) switched them off
                self._heartbeat_seq += 1
                self._outbox.put_nowait(heartbeat_msg(self._heartbeat_seq))
            await asyncio.sleep(self.config.heartbeat_interval_s)
