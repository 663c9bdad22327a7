"""KV control plane over gRPC, prefill side: ControlServer, the checks it applies, shared errors.

The decode side is kvtransfer.control.client.ControlClient.

One long-lived bidirectional stream per (decode worker, prefill worker) pair, defined in
proto/kv_control.proto. The decode side registers (name, backend metadata, KV layout), then sends
TransferInfo per room and Abort when it gives a room up, plus heartbeats. The prefill side checks
every message and answers on the stream; an invalid message is answered with a reason and never
applied. Valid TransferInfo, aborts, registrations and lost peers reach the prefill role as plain
values on `ControlServer.events`; the role reports progress back with `ControlServer.send_status`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

import grpc
import structlog

from disagg.pd_config import ControlConfig
from disagg.wire import kv_control_pb2 as pb
from disagg.wire import kv_control_pb2_grpc as pb_grpc
from disagg.wire.auth import (
    CONTROL, CONTROL_AUTH_KEY, NONCE_BYTES, NonceTable, ProofRefused, check_proof, format_address, reply,
)
from disagg.wire.control_msgs import (
    AbortMsg,
    LeaseMsg,
    LeaseStatusMsg,
    PeerLostMsg,
    PeerMsg,
    TransferInfoMsg,
    TransferState,
    TransferStatusMsg,
    heartbeat_ack_msg,
    lease_status_msg,
    peer_from_pb,
    register_ack_msg,
    status_msg,
    transfer_info_from_pb,
)
from kvtransfer.base import AuthenticationFailed, IncompatiblePeer, KVTransferError, PeerUnavailable
from kvtransfer.control.checks import check_peer, check_transfer
from kvtransfer.faulty import heartbeats_paused

__all__ = ["AuthenticationFailed", "ControlError", "ControlServer", "PeerRejected", "PeerUnavailable", "check_peer",
           "check_transfer"]
Clock = Callable[[], float]
ControlEvent = PeerMsg | TransferInfoMsg | AbortMsg | LeaseMsg | PeerLostMsg
log = structlog.get_logger("kvtransfer.control")


class ControlError(KVTransferError):
    """Misuse of the control plane (a second start, a room sent twice)."""


class PeerRejected(IncompatiblePeer):
    """The prefill worker refused our registration; `reason` says why."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"prefill {address} refused registration: {reason}")
        self.reason = reason


def grpc_options(config: ControlConfig) -> list[tuple[str, int]]:
    """Channel and server options shared by both ends of the control plane."""
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),  # two servers must never share a port
    ]


# --- server (prefill side) -----------------------------------------------------------------------


class _Session:
    """One decode stream: who it authenticated as, its registered peer, its active rooms and its
    outgoing messages."""

    def __init__(self, now: float, identity: str | None = None) -> None:
        self.identity = identity  # the peer name its cluster secret proof named; None without a secret
        self.peer: PeerMsg | None = None
        self.rooms: set[int] = set()
        self.outbox: asyncio.Queue[pb.PrefillMsg | None] = asyncio.Queue()
        self.end_reason = "decode closed the stream"
        self.last_seen = now

    def end(self, reason: str) -> None:
        """Close the stream from our side; the handler drops the session on its way out."""
        self.end_reason = reason
        self.outbox.put_nowait(None)

    def send(self, msg: pb.PrefillMsg) -> None:
        self.outbox.put_nowait(msg)

    @property
    def name(self) -> str:
        return self.peer.peer_name if self.peer is not None else "<unregistered>"


class _Servicer(pb_grpc.KVControlServicer):
    def __init__(self, server: ControlServer):
        self._server = server

    async def Challenge(self, request, context):  # noqa: N802 (gRPC method name)
        return self._server._challenge()

    async def Connect(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        identity, refusal = await self._server._authenticate(context)
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
        session = _Session(self._server._clock(), identity)
        self._server._streams.add(session)
        reader = asyncio.create_task(self._server._read_stream(session, request_iterator))
        try:
            while (msg := await session.outbox.get()) is not None:
                yield msg
        finally:
            reader.cancel()
            self._server._streams.discard(session)
            self._server._drop_session(session, session.end_reason)


class ControlServer:
    """gRPC control-plane server of one prefill worker. Use as an async context manager.

    `local` describes this worker (its layout is what decode layouts are checked against). Events
    for the prefill role arrive on `events`: PeerMsg (a decode registered: add it to the transfer
    backend), TransferInfoMsg (valid destination blocks for a room), AbortMsg, PeerLostMsg, LeaseMsg;
    `on_event` (if given) is called after each one is queued, so an idle role wakes at once.
    """

    def __init__(self, local: PeerMsg, config: ControlConfig = ControlConfig(), clock: Clock = time.monotonic, *,
                 cluster_secret: str | None = None, on_event: Callable[[], None] | None = None):
        self.local = local
        self.config = config
        self._clock = clock
        self._cluster_secret = cluster_secret  # None: every stream is accepted (as without a secret upstream)
        self._nonces = NonceTable(config.challenge_ttl_s)
        self.address: str | None = None  # host:port once started: the target a decode's proof must name
        self._watchdog: asyncio.Task | None = None
        self.events: asyncio.Queue[ControlEvent] = asyncio.Queue()
        self._on_event = on_event
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._streams: set[_Session] = set()
        self._sessions: dict[str, _Session] = {}
        self._rooms: dict[int, tuple[_Session, TransferInfoMsg]] = {}
        self._aborting: set[int] = set()  # rooms the decode aborted, until the role's final status

    def _emit(self, event: ControlEvent) -> None:
        self.events.put_nowait(event)
        if self._on_event is not None:
            self._on_event()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on host:port (0: a free port); returns the actual port."""
        if self._server is not None:
            raise ControlError("control server already started")
        server = grpc.aio.server(options=grpc_options(self.config))
        pb_grpc.add_KVControlServicer_to_server(_Servicer(self), server)
        try:
            bound = server.add_insecure_port(format_address(host, port))
        except RuntimeError as exc:
            raise ControlError(f"cannot bind the control server to {format_address(host, port)}: {exc}") from None
        await server.start()
        self._server, self.port, self.address = server, bound, format_address(host, bound)
        self._watchdog = asyncio.create_task(self._watch_streams())
        log.info("control server started", address=self.address, peer=self.local.peer_name)
        return bound

    async def close(self) -> None:
        """Stop serving: end every open stream cleanly, then stop within `close_grace_s`; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        for session in self._streams:
            session.end("control server closed")
        await server.stop(self.config.close_grace_s)

    def _challenge(self) -> pb.ChallengeReply:
        """A fresh nonce for a decode to answer (remembered only when we hold a secret)."""
        nonce = os.urandom(NONCE_BYTES)
        if self._cluster_secret is not None:
            self._nonces.issue(nonce, self._clock())
        return pb.ChallengeReply(nonce=nonce, ttl_s=self.config.challenge_ttl_s)

    async def _authenticate(self, context) -> tuple[str | None, str | None]:
        """Check a new stream's cluster secret proof: (the peer name it proved, None) with our proof back
        sent, or (None, why it is refused). Without a secret: (None, None)."""
        if self._cluster_secret is None:
            return None, None
        proof = dict(context.invocation_metadata() or ()).get(CONTROL_AUTH_KEY)
        try:
            binding = check_proof(self._cluster_secret, CONTROL, proof, targets=(self.address,), nonces=self._nonces,
                                  now=self._clock())
        except ProofRefused as exc:
            log.warning("control stream refused", peer_address=context.peer(), reason=exc.reason)
            return None, exc.reason
        await context.send_initial_metadata(((CONTROL_AUTH_KEY, reply(self._cluster_secret, CONTROL, binding)),))
        return binding.client, None

    async def _watch_streams(self) -> None:
        # A decode host that vanishes without closing its socket leaves the stream open; its
        # missing heartbeats end the session so the prefill role frees that peer's rooms.
        limit_s = 2 * self.config.heartbeat_interval_s * self.config.heartbeat_max_misses
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            now = self._clock()
            for session in list(self._streams):
                if now - session.last_seen > limit_s:
                    session.last_seen = float("inf")  # end once
                    session.end(f"no message from decode for {limit_s:g} s")

    async def __aenter__(self) -> ControlServer:
        if self._server is None:
            await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    @property
    def peers(self) -> dict[str, PeerMsg]:
        """Registered decode peers by name."""
        return {name: s.peer for name, s in self._sessions.items() if s.peer is not None}

    @property
    def active_rooms(self) -> dict[int, TransferInfoMsg]:
        """Rooms with accepted TransferInfo and no final status yet."""
        return {room: info for room, (_, info) in self._rooms.items()}

    def send_status(self, status: TransferStatusMsg) -> bool:
        """Report a room's progress to its decode peer. A final state ends the room.

        Returns False (and sends nothing) for a room that is not active: aborted, lost with its
        peer or already final. A late FAILED never recreates a cleared room.
        """
        entry = self._rooms.get(status.room)
        if entry is None:
            return False
        session = entry[0]
        if status.state.is_terminal:
            del self._rooms[status.room]
            self._aborting.discard(status.room)
            session.rooms.discard(status.room)
        session.send(status_msg(status))
        return True

    def send_lease(self, peer_name: str, status: LeaseStatusMsg) -> bool:
        """Answer a decode's claim or release (pull flow); False when its stream is gone."""
        session = self._sessions.get(peer_name)
        if session is None:
            return False
        session.send(lease_status_msg(status))
        return True

    def drop_peer(self, peer_name: str, reason: str) -> bool:
        """End a decode's stream from our side (e.g. its transfers are stuck): its rooms are lost
        (PeerLostMsg), and the decode, seeing the stream end, cuts us off before reusing blocks."""
        session = self._sessions.get(peer_name)
        if session is None:
            return False
        self._drop_session(session, reason)
        session.end(reason)
        return True

    def is_writable(self, room: int) -> bool:
        """True while the room's decode still wants its KV: active, not aborted, its stream alive.
        The prefill checks this before posting each write."""
        return room in self._rooms and room not in self._aborting

    async def _read_stream(self, session: _Session, requests) -> None:
        try:
            async for msg in requests:
                self._on_message(session, msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a broken stream ends this session only
            session.end(f"stream failed: {exc}")
            return
        session.end(session.end_reason)

    def _on_message(self, session: _Session, msg: pb.DecodeMsg) -> None:
        session.last_seen = self._clock()
        kind = msg.WhichOneof("payload")
        if kind == "register_peer":
            self._on_register(session, peer_from_pb(msg.register_peer.peer))
        elif kind == "transfer_info":
            self._on_transfer(session, transfer_info_from_pb(msg.transfer_info))
        elif kind == "abort":
            self._on_abort(session, msg.abort.room, msg.abort.reason)
        elif kind == "heartbeat":
            if not heartbeats_paused():  # fault injection (kvtransfer/faulty.py) switched them off
                session.send(heartbeat_ack_msg(msg.heartbeat.seq))
        elif kind in ("claim", "release") and session.peer is None:
            log.warning("lease message before RegisterPeer ignored", kind=kind)
        elif kind == "claim":
            self._emit(LeaseMsg(request_id=msg.claim.request_id, peer_name=session.name))
        elif kind == "release":
            release = msg.release
            self._emit(LeaseMsg(request_id=release.request_id, peer_name=session.name, release=True,
                                reason=release.reason,
                                digest_blocks=(release.digest_first_block, release.digest_num_blocks)))
        else:
            log.warning("control message without payload ignored", peer=session.name)

    def _on_register(self, session: _Session, peer: PeerMsg) -> None:
        # Only an authenticated stream (or any, without a secret) gets here: the layout details of
        # check_peer never reach a peer that has not proved the cluster secret.
        if session.peer is not None:
            reason = f"stream already registered as peer {session.peer.peer_name!r}"
        elif session.identity is not None and peer.peer_name != session.identity:
            reason = f"peer {peer.peer_name!r} registered on a stream authenticated as {session.identity!r}"
        else:
            reason = check_peer(self.local, peer)
        if reason is not None:
            log.warning("peer registration refused", peer=peer.peer_name, reason=reason)
            session.send(register_ack_msg(False, reason))
            return
        old = self._sessions.get(peer.peer_name)
        if old is not None:
            # The same worker reconnected (restart, network blip): the new stream wins.
            self._drop_session(old, "peer registered again on a new stream")
            old.end("peer registered again on a new stream")
        session.peer = peer
        self._sessions[peer.peer_name] = session
        session.send(register_ack_msg(True, peer=self.local))
        self._emit(peer)
        log.info("peer registered", peer=peer.peer_name, backend=peer.transfer_backend)

    def _transfer_rejection(self, session: _Session, info: TransferInfoMsg) -> str | None:
        if session.peer is None:
            return "peer not registered: send RegisterPeer before TransferInfo"
        if info.peer_name != session.peer.peer_name:
            if info.peer_name in self._sessions:
                return f"TransferInfo for peer {info.peer_name!r} arrived on the stream of peer {session.name!r}"
            return f"unknown peer {info.peer_name!r}"
        active = self._rooms.get(info.room)
        if active is not None and active[1] != info:
            return f"room {info.room} is already active with different transfer info"
        return check_transfer(info, session.peer)

    def _on_transfer(self, session: _Session, info: TransferInfoMsg) -> None:
        reason = self._transfer_rejection(session, info)
        if reason is not None:
            log.warning("transfer info refused", peer=session.name, room=info.room, reason=reason)
            session.send(status_msg(TransferStatusMsg(room=info.room, state=TransferState.FAILED, reason=reason)))
            return
        if info.room in self._rooms:
            return  # the same TransferInfo again (a retry): already handed over
        self._rooms[info.room] = (session, info)
        session.rooms.add(info.room)
        self._emit(info)

    def _on_abort(self, session: _Session, room: int, reason: str) -> None:
        entry = self._rooms.get(room)
        if entry is None or entry[0] is not session:
            # Already final, or never reached us: nothing was or will be written. Say so, so the
            # decode can reuse its blocks now (its abort waits for a final status of the room).
            if entry is None:
                session.send(status_msg(TransferStatusMsg(room=room, state=TransferState.FAILED,
                                                          reason=f"aborted by decode: {reason}")))
            return
        if room in self._aborting:
            return
        # The room stays active until the prefill role sends its final status: that status is the
        # acknowledgement the decode waits for before it reuses the destination blocks.
        self._aborting.add(room)
        self._emit(AbortMsg(room=room, reason=reason, peer_name=session.name))

    def _drop_session(self, session: _Session, reason: str) -> None:
        if session.peer is None or self._sessions.get(session.peer.peer_name) is not session:
            return
        del self._sessions[session.peer.peer_name]
        rooms = tuple(sorted(session.rooms))
        for room in rooms:
            del self._rooms[room]
            self._aborting.discard(room)
        session.rooms.clear()
        self._emit(PeerLostMsg(peer_name=session.peer.peer_name, reason=reason, rooms=rooms))
        log.info("peer lost", peer=session.peer.peer_name, reason=reason, rooms=len(rooms))
