"""KV control plane: a real grpc.aio server and client on 127.0.0.1 (port 0)."""

import asyncio
import importlib.util
import pathlib
import socket
import subprocess
import sys
import time

import grpc
import msgspec
import pytest
from fake_engine import wait_for
from structlog.testing import capture_logs

from disagg.pd_config import ControlConfig
from disagg.wire import kv_control_pb2 as pb
from disagg.wire import kv_control_pb2_grpc as pb_grpc
from disagg.wire.auth import CONTROL, CONTROL_AUTH_KEY, Binding, answer
from disagg.wire.control_msgs import (
    AbortMsg,
    LeaseMsg,
    LeaseStatusMsg,
    KVLayoutMsg,
    PeerLostMsg,
    PeerMsg,
    TransferInfoMsg,
    TransferState,
    TransferStatusMsg,
    register_ack_msg,
    register_msg,
    status_from_pb,
    status_to_pb,
    transfer_msg,
)
from kvtransfer.control.client import ControlClient
from kvtransfer.control.server import AuthenticationFailed, ControlError, ControlServer, PeerRejected, PeerUnavailable

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAYOUT = KVLayoutMsg(num_blocks=32, block_size_tokens=16, block_size_bytes=4096, dtype="bfloat16", num_layers=2)
PREFILL = PeerMsg(peer_name="prefill-0", transfer_backend="tcp", agent_metadata=b"P0",
                  layout=msgspec.structs.replace(LAYOUT, num_blocks=64))
DECODE = PeerMsg(peer_name="decode-0", transfer_backend="tcp", agent_metadata=b"D0", layout=LAYOUT, dp_rank=1)
FAST = ControlConfig(connect_timeout_s=2.0, heartbeat_interval_s=0.1, heartbeat_max_misses=3, close_grace_s=0.1)
FAILED = TransferState.FAILED


def info(room=7, blocks=(3, 4, 5), **kw):
    return TransferInfoMsg(room=room, peer_name=kw.pop("peer_name", "decode-0"), dst_block_ids=tuple(blocks), **kw)


def failed(room, reason, peer_lost=False):
    return TransferStatusMsg(room=room, state=FAILED, reason=reason, peer_lost=peer_lost)


@pytest.fixture
async def server():
    async with ControlServer(PREFILL, FAST) as srv:
        yield srv


@pytest.fixture
async def client(server):
    async with ControlClient(f"127.0.0.1:{server.port}", DECODE, FAST) as cli:
        assert await asyncio.wait_for(server.events.get(), 2) == DECODE
        yield cli


async def test_happy_path_transfer_info_in_statuses_out(server, client):
    assert client.remote == PREFILL
    assert server.peers == {"decode-0": DECODE}
    future = client.send_transfer(info(num_prompt_tokens=40, first_token_slot=2, request_id="r1"))
    assert await asyncio.wait_for(server.events.get(), 2) == TransferInfoMsg(
        room=7, peer_name="decode-0", dst_block_ids=(3, 4, 5), first_token_slot=2, num_prompt_tokens=40,
        request_id="r1")
    progress = TransferStatusMsg(room=7, state=TransferState.TRANSFERRING, num_bytes=4096)
    assert server.send_status(progress) is True
    done = TransferStatusMsg(room=7, state=TransferState.SUCCESS, first_token_id=42,
                             first_token_logprob=-0.5, num_bytes=12288)
    assert server.send_status(done) is True
    assert await asyncio.wait_for(future, 2) == done
    assert client.pending_rooms == [] and server.active_rooms == {}
    assert server.send_status(failed(7, "late")) is False  # a cleared room is never recreated


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(layout=msgspec.structs.replace(LAYOUT, block_size_tokens=32)),
         "page size mismatch: prefill block_size_tokens=16, decode block_size_tokens=32"),
        (dict(layout=msgspec.structs.replace(LAYOUT, dtype="float32")),
         "kv cache dtype mismatch: prefill dtype=bfloat16, decode dtype=float32"),
        (dict(layout=msgspec.structs.replace(LAYOUT, num_layers=3)),
         "num_layers mismatch: prefill num_layers=2, decode num_layers=3"),
        (dict(layout=msgspec.structs.replace(LAYOUT, num_blocks=0)), "num_blocks must be positive, got 0"),
        (dict(transfer_backend="nixl"), "transfer backend mismatch: prefill uses 'tcp', decode uses 'nixl'"),
        (dict(peer_name=""), "peer_name must not be empty"),
    ],
)
async def test_registration_is_refused_with_a_reason(server, change, reason):
    decode = msgspec.structs.replace(DECODE, **change)
    with pytest.raises(PeerRejected) as exc:
        await ControlClient(f"127.0.0.1:{server.port}", decode, FAST).connect()
    assert exc.value.reason == reason
    assert str(exc.value) == f"prefill 127.0.0.1:{server.port} refused registration: {reason}"
    assert server.peers == {} and server.events.empty()


@pytest.mark.parametrize(
    "bad, reason",
    [
        (info(8, (3, 32)), "room 8: destination block id 32 is out of range [0, 32) of peer 'decode-0'"),
        (info(8, (-1,)), "room 8: destination block id -1 is out of range [0, 32) of peer 'decode-0'"),
        (info(8, (2, 2)), "room 8: destination block id 2 appears twice"),
        (info(8, ()), "room 8: no destination block ids"),
        (info(8, (1, 2), num_prompt_tokens=33), "room 8: 2 destination blocks hold 32 tokens, the prompt has 33"),
        (info(8, (1, 2), num_prompt_tokens=49, num_cached_tokens=16),
         "room 8: 2 destination blocks hold 32 tokens, the prompt has 33 after the 16 the decode holds"),
        (info(8, (1, 2), num_prompt_tokens=40, num_cached_tokens=8),
         "room 8: num_cached_tokens 8 is not a whole number of 16-token pages"),
        (info(8, (1,), num_prompt_tokens=32, num_cached_tokens=32),
         "room 8: num_cached_tokens 32 leaves nothing of the 32-token prompt to send"),
        (info(8, peer_name="decode-9"), "unknown peer 'decode-9'"),
        (info(7, (9, 10)), "room 7 is already active with different transfer info"),
    ],
)
async def test_invalid_transfer_info_is_refused_and_never_applied(server, client, bad, reason):
    client.send_transfer(info(7))
    assert (await asyncio.wait_for(server.events.get(), 2)).room == 7
    if bad.room == 7:  # same room from another decode worker, which the server must refuse
        async with ControlClient(f"127.0.0.1:{server.port}", msgspec.structs.replace(DECODE, peer_name="decode-1"),
                                 FAST) as other:
            await server.events.get()
            result = await asyncio.wait_for(other.send_transfer(msgspec.structs.replace(bad, peer_name="decode-1")), 2)
        assert result == failed(7, reason)
        assert await asyncio.wait_for(server.events.get(), 2) == PeerLostMsg(
            peer_name="decode-1", reason="decode closed the stream", rooms=())
    else:
        assert await asyncio.wait_for(client.send_transfer(bad), 2) == failed(bad.room, reason)
    assert server.events.empty()
    assert list(server.active_rooms) == [7]


async def test_transfer_info_on_another_peers_stream_is_refused(server, client):
    async with ControlClient(f"127.0.0.1:{server.port}", msgspec.structs.replace(DECODE, peer_name="decode-1"),
                             FAST) as other:
        await server.events.get()
        result = await asyncio.wait_for(other.send_transfer(info(5)), 2)
    assert result == failed(5, "TransferInfo for peer 'decode-0' arrived on the stream of peer 'decode-1'")
    assert server.active_rooms == {}


async def test_transfer_info_before_registration_is_refused(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.KVControlStub(channel).Connect()
        await call.write(transfer_msg(info(3)))
        answer = await asyncio.wait_for(call.read(), 2)
        assert status_from_pb(answer.status) == failed(3, "peer not registered: send RegisterPeer before TransferInfo")
        await call.write(register_msg(DECODE))
        assert (await asyncio.wait_for(call.read(), 2)).register_ack.accepted
        await call.write(register_msg(DECODE))
        second = await asyncio.wait_for(call.read(), 2)
        assert (second.register_ack.accepted, second.register_ack.reason) == (
            False, "stream already registered as peer 'decode-0'")
        await call.done_writing()
    assert server.active_rooms == {}


async def test_abort_fails_the_room_locally_and_fences_it_when_the_prefill_acknowledges(server, client):
    future = client.send_transfer(info(11))
    await asyncio.wait_for(server.events.get(), 2)
    fence = client.abort(11, "client went away")
    assert future.result() == failed(11, "aborted: client went away")
    assert await asyncio.wait_for(server.events.get(), 2) == AbortMsg(room=11, reason="client went away",
                                                                      peer_name="decode-0")
    # Until the prefill role says it stopped writing, the room stays active and unwritable.
    assert (list(server.active_rooms), server.is_writable(11), fence.done()) == ([11], False, False)
    assert client.abort(11, "again") is fence
    assert server.send_status(failed(11, "aborted by decode: client went away")) is True
    assert await asyncio.wait_for(fence, 2) is True
    assert server.active_rooms == {}
    assert server.send_status(TransferStatusMsg(room=11, state=TransferState.SUCCESS)) is False


async def test_abort_of_a_final_room_is_fenced_at_once_and_a_lost_stream_fences_false(server, client):
    future = client.send_transfer(info(12))
    await asyncio.wait_for(server.events.get(), 2)
    assert server.send_status(failed(12, "prefill gave up")) is True
    assert await asyncio.wait_for(future, 2) == failed(12, "prefill gave up")
    assert await client.abort(12, "late") is True
    client.send_transfer(info(13))
    await asyncio.wait_for(server.events.get(), 2)
    fence = client.abort(13, "client went away")
    client.drop("test: the prefill never answered")
    assert await asyncio.wait_for(fence, 2) is False
    assert await client.abort(14, "after the loss") is False


async def test_closing_the_client_reports_the_peer_lost_with_its_rooms(server):
    cli = ControlClient(f"127.0.0.1:{server.port}", DECODE, FAST)
    await cli.connect()
    await server.events.get()
    future = cli.send_transfer(info(21))
    await asyncio.wait_for(server.events.get(), 2)
    await cli.close()
    assert future.result() == failed(21, "control client closed")
    assert await asyncio.wait_for(server.events.get(), 2) == PeerLostMsg(
        peer_name="decode-0", reason="decode closed the stream", rooms=(21,))
    assert server.peers == {} and server.active_rooms == {}
    with pytest.raises(PeerUnavailable, match=r"is down: control client closed$"):
        cli.send_transfer(info(22))


async def test_stopping_the_server_fails_pending_rooms_without_hanging():
    server = ControlServer(PREFILL, FAST)
    port = await server.start()
    async with ControlClient(f"127.0.0.1:{port}", DECODE, FAST) as cli:
        future = cli.send_transfer(info(31))
        assert await asyncio.wait_for(server.events.get(), 2) == DECODE
        assert await asyncio.wait_for(server.events.get(), 2) == info(31)
        start = time.monotonic()
        await server.close()
        result = await asyncio.wait_for(future, 2)
        assert time.monotonic() - start < 2.0
        assert result == failed(31, f"lost connection to prefill 127.0.0.1:{port}: stream closed by the prefill", peer_lost=True)
        assert await asyncio.wait_for(server.events.get(), 2) == PeerLostMsg(
            peer_name="decode-0", reason="control server closed", rooms=(31,))
        assert not cli.is_alive
        with pytest.raises(PeerUnavailable):
            cli.send_transfer(info(32))


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "a room in flight"])
async def test_a_stopped_prefill_is_a_warning_only_when_something_was_in_flight(busy):
    from structlog.testing import capture_logs

    server = ControlServer(PREFILL, FAST)
    port = await server.start()
    with capture_logs() as logs:
        async with ControlClient(f"127.0.0.1:{port}", DECODE, FAST) as cli:
            assert await asyncio.wait_for(server.events.get(), 2) == DECODE
            if busy:
                future = cli.send_transfer(info(41))
                assert await asyncio.wait_for(server.events.get(), 2) == info(41)
            await server.close()
            await wait_for(lambda: not cli.is_alive, 2)
            if busy:
                assert (await asyncio.wait_for(future, 2)).peer_lost
    got = [(e["log_level"], e["event"], e["rooms"]) for e in logs
           if e["event"] in ("control stream lost", "control stream closed")]
    assert got == ([("warning", "control stream lost", 1)] if busy else [("info", "control stream closed", 0)])


class SilentPrefill(pb_grpc.KVControlServicer):
    """Accepts the registration, then never answers again and never closes the stream."""

    async def Connect(self, request_iterator, context):  # noqa: N802
        async for msg in request_iterator:
            if msg.WhichOneof("payload") == "register_peer":
                yield register_ack_msg(True, peer=PREFILL)


@pytest.fixture
async def silent_prefill_port():
    """The port of a SilentPrefill served on loopback (stopped after the test)."""
    grpc_server = grpc.aio.server()
    pb_grpc.add_KVControlServicer_to_server(SilentPrefill(), grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    try:
        yield port
    finally:
        await grpc_server.stop(0)


async def test_missed_heartbeats_fail_every_pending_room(silent_prefill_port):
    port = silent_prefill_port
    async with ControlClient(f"127.0.0.1:{port}", DECODE, FAST) as cli:
        start = time.monotonic()
        futures = [cli.send_transfer(info(room)) for room in (1, 2)]
        results = await asyncio.wait_for(asyncio.gather(*futures), 2)
        elapsed = time.monotonic() - start
        reason = f"lost connection to prefill 127.0.0.1:{port}: 3 heartbeats missed"
        assert results == [failed(1, reason, peer_lost=True), failed(2, reason, peer_lost=True)]
        assert 0.2 <= elapsed < 1.5  # three intervals of 0.1 s, plus scheduling


async def test_a_lost_stream_fails_claims_and_releases_as_peer_lost(silent_prefill_port):
    """Pull flow: a claim pending when the stream breaks, and a release after, answer not ok with
    peer_lost set (the decode answers 503: the prefill is unavailable, the request is not bad)."""
    port = silent_prefill_port
    async with ControlClient(f"127.0.0.1:{port}", DECODE, FAST) as cli:
        claim = await asyncio.wait_for(cli.claim("req-1"), 2)
        release = await asyncio.wait_for(cli.release("req-1"), 2)
    reason = f"lost connection to prefill 127.0.0.1:{port}: 3 heartbeats missed"
    assert claim == LeaseStatusMsg(request_id="req-1", ok=False, reason=reason, released=False, peer_lost=True)
    assert release == LeaseStatusMsg(request_id="req-1", ok=False, reason=reason, released=True, peer_lost=True)


async def test_a_silent_decode_is_dropped_with_its_rooms(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = pb_grpc.KVControlStub(channel).Connect()
        await call.write(register_msg(DECODE))
        await call.write(transfer_msg(info(51)))
        assert await asyncio.wait_for(server.events.get(), 2) == DECODE
        assert await asyncio.wait_for(server.events.get(), 2) == info(51)
        start = time.monotonic()
        lost = await asyncio.wait_for(server.events.get(), 3)
        assert 0.5 <= time.monotonic() - start < 2.0
        assert lost == PeerLostMsg(peer_name="decode-0", reason="no message from decode for 0.6 s", rooms=(51,))
        assert (await call.read()).register_ack.accepted
        assert await asyncio.wait_for(call.read(), 2) is grpc.aio.EOF
    assert server.peers == {} and server.active_rooms == {}


async def test_reregistering_the_same_peer_replaces_the_old_stream(server, client):
    future = client.send_transfer(info(41))
    await asyncio.wait_for(server.events.get(), 2)
    async with ControlClient(f"127.0.0.1:{server.port}", DECODE, FAST):
        assert await asyncio.wait_for(server.events.get(), 2) == PeerLostMsg(
            peer_name="decode-0", reason="peer registered again on a new stream", rooms=(41,))
        assert await asyncio.wait_for(server.events.get(), 2) == DECODE
        result = await asyncio.wait_for(future, 2)
    assert result == failed(41, f"lost connection to prefill 127.0.0.1:{server.port}: stream closed by the prefill",
                            peer_lost=True)


async def test_unreachable_prefill_and_client_misuse():
    probe = ControlServer(PREFILL, FAST)
    port = await probe.start()
    await probe.close()
    # Refused (nothing listens: a dead worker's address): at once, not at the (hour-long) connect timeout.
    with pytest.raises(PeerUnavailable) as exc:
        patient = ControlClient(f"127.0.0.1:{port}", DECODE, ControlConfig(connect_timeout_s=3600))
        await asyncio.wait_for(patient.connect(), 10)
    assert str(exc.value) == f"cannot reach prefill 127.0.0.1:{port}: its connection failed (no worker listens there)"
    # Accepted by the kernel but never answered (a hung peer): at the connect timeout.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        mute_port = mute.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(PeerUnavailable) as exc:
            await ControlClient(f"127.0.0.1:{mute_port}", DECODE, ControlConfig(connect_timeout_s=0.3)).connect()
        assert time.monotonic() - start < 2.0
    assert str(exc.value) == f"cannot reach prefill 127.0.0.1:{mute_port} within 0.3 s (timed out)"
    async with ControlServer(PREFILL, FAST) as srv, ControlClient(f"127.0.0.1:{srv.port}", DECODE, FAST) as cli:
        cli.send_transfer(info(1))
        with pytest.raises(ControlError, match=r"^room 1 already has a transfer in flight to prefill "):
            cli.send_transfer(info(1))
        with pytest.raises(ControlError, match=r"^control server already started$"):
            await srv.start()


SECRET = "control-secret"
NO_SECRET = "no cluster secret sent: this prefill requires one (set --cluster-secret on the decode)"
MISMATCH = "cluster secret mismatch: the decode's --cluster-secret differs from the prefill's"


@pytest.mark.parametrize("secret, reason", [(None, NO_SECRET), ("other-secret", MISMATCH)], ids=["none", "wrong"])
async def test_a_stream_without_the_cluster_secret_is_refused(secret, reason):
    async with ControlServer(PREFILL, FAST, cluster_secret=SECRET) as srv:
        with capture_logs() as logs, pytest.raises(AuthenticationFailed) as exc:
            await ControlClient(f"127.0.0.1:{srv.port}", DECODE, FAST, cluster_secret=secret).connect()
        assert type(exc.value) is AuthenticationFailed
        assert str(exc.value) == f"prefill 127.0.0.1:{srv.port} refused the control stream: {reason}"
        # One refusal per attempt: under load grpc can end a refused attempt with a retryable code
        # (the client then tries again within connect_timeout_s and is refused again).
        refusals = [e["reason"] for e in logs if e["event"] == "control stream refused"]
        assert refusals[:1] == [reason] and set(refusals) == {reason}
        assert srv.peers == {} and srv.events.empty()


async def test_the_right_cluster_secret_registers_and_transfers():
    async with ControlServer(PREFILL, FAST, cluster_secret=SECRET) as srv, ControlClient(
            f"127.0.0.1:{srv.port}", DECODE, FAST, cluster_secret=SECRET) as cli:
        assert cli.remote == PREFILL
        assert await asyncio.wait_for(srv.events.get(), 2) == DECODE
        future = cli.send_transfer(info(9))
        assert await asyncio.wait_for(srv.events.get(), 2) == info(9)
        done = TransferStatusMsg(room=9, state=TransferState.SUCCESS, first_token_id=4, num_bytes=12288)
        assert srv.send_status(done) is True
        assert await asyncio.wait_for(future, 2) == done


async def test_a_prefill_without_the_secret_is_refused_by_a_decode_holding_one():
    """The decode checks the prefill's reply: a prefill that cannot prove the secret gets no TransferInfo."""
    async with ControlServer(PREFILL, FAST) as srv:
        with pytest.raises(AuthenticationFailed) as exc:
            await ControlClient(f"127.0.0.1:{srv.port}", DECODE, FAST, cluster_secret=SECRET).connect()
    assert str(exc.value) == (f"prefill 127.0.0.1:{srv.port} did not prove it holds the cluster secret "
                              "(started without --cluster-secret, or with another one?)")


async def challenge(channel) -> pb.ChallengeReply:
    return await pb_grpc.KVControlStub(channel).Challenge(pb.ChallengeRequest())


def proof(nonce: bytes, target: str, client: str = "decode-0", secret: str = SECRET) -> str:
    return answer(secret, CONTROL, Binding(nonce, b"c" * 32, client, target))


async def raw_register(channel, token: str, peer: PeerMsg = DECODE):
    """A Connect call carrying `token` that sends RegisterPeer: its first answer, or the AioRpcError
    that ended it. A refusal that raced our write (INTERNAL) is tried again, as ControlClient does."""
    for _ in range(20):
        call = pb_grpc.KVControlStub(channel).Connect(metadata=((CONTROL_AUTH_KEY, token),))
        try:
            await call.write(register_msg(peer))
            return await asyncio.wait_for(call.read(), 2)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.INTERNAL:
                return exc
        finally:
            call.cancel()
    raise AssertionError("every attempt ended INTERNAL")


def refused(answer_or_error) -> tuple:
    assert isinstance(answer_or_error, grpc.aio.AioRpcError), answer_or_error
    return answer_or_error.code(), answer_or_error.details()


USED = "cluster secret proof was already used: this prefill accepts each answer once"
STALE = "cluster secret proof answers no live challenge of this prefill (unknown or expired nonce)"


async def test_a_replayed_proof_is_refused_after_its_first_use():
    """One proof sent 5 times: the first stream registers, the 4 replays are refused before any message."""
    async with ControlServer(PREFILL, FAST, cluster_secret=SECRET) as srv, grpc.aio.insecure_channel(
            f"127.0.0.1:{srv.port}") as channel:
        issued = await challenge(channel)
        assert (len(issued.nonce), issued.ttl_s) == (32, 10.0)
        token = proof(issued.nonce, f"127.0.0.1:{srv.port}")
        first = pb_grpc.KVControlStub(channel).Connect(metadata=((CONTROL_AUTH_KEY, token),))
        await first.write(register_msg(DECODE))
        ack = (await asyncio.wait_for(first.read(), 2)).register_ack
        assert (ack.accepted, ack.peer.peer_name) == (True, "prefill-0")
        with capture_logs() as logs:
            replays = [refused(await raw_register(channel, token)) for _ in range(4)]
        assert replays == [(grpc.StatusCode.UNAUTHENTICATED, USED)] * 4
        reasons = [e["reason"] for e in logs if e["event"] == "control stream refused"]
        assert set(reasons) == {USED} and len(reasons) >= 4  # one per attempt (a raced one is tried again)
        assert srv.peers == {"decode-0": DECODE}
        assert await asyncio.wait_for(srv.events.get(), 2) == DECODE and srv.events.empty()
        first.cancel()


async def test_a_proof_made_for_another_prefill_is_refused():
    """A proof is bound to the address the decode dialed: made for A, it is refused by B, whichever
    nonce it answers and however its target is rewritten."""
    async with ControlServer(PREFILL, FAST, cluster_secret=SECRET) as a, ControlServer(
            PREFILL, FAST, cluster_secret=SECRET) as b, grpc.aio.insecure_channel(
            f"127.0.0.1:{a.port}") as to_a, grpc.aio.insecure_channel(f"127.0.0.1:{b.port}") as to_b:
        target_a, target_b = f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"
        for_a = proof((await challenge(to_b)).nonce, target_a)  # B's challenge, relayed to a decode dialing A
        assert refused(await raw_register(to_b, for_a)) == (
            grpc.StatusCode.UNAUTHENTICATED, f"cluster secret proof was made for {target_a}, this prefill is {target_b}")
        fields = for_a.split(".")
        fields[4] = target_b.encode().hex()  # the target rewritten: the HMAC no longer matches
        assert refused(await raw_register(to_b, ".".join(fields))) == (grpc.StatusCode.UNAUTHENTICATED, MISMATCH)
        a_nonce = proof((await challenge(to_a)).nonce, target_b)  # A's nonce is no challenge of B
        assert refused(await raw_register(to_b, a_nonce)) == (grpc.StatusCode.UNAUTHENTICATED, STALE)
        assert a.peers == b.peers == {} and a.events.empty() and b.events.empty()


async def test_an_expired_challenge_is_refused_before_any_message():
    now = [100.0]
    async with ControlServer(PREFILL, FAST, lambda: now[0], cluster_secret=SECRET) as srv, grpc.aio.insecure_channel(
            f"127.0.0.1:{srv.port}") as channel:
        token = proof((await challenge(channel)).nonce, f"127.0.0.1:{srv.port}")
        now[0] += 10.0  # challenge_ttl_s
        assert refused(await raw_register(channel, token)) == (grpc.StatusCode.UNAUTHENTICATED, STALE)
        for bad in ("", "v1.1700000000.00.ff", token[:-1]):
            assert refused(await raw_register(channel, bad)) == (
                grpc.StatusCode.UNAUTHENTICATED, NO_SECRET if not bad else "malformed cluster secret proof")
        assert srv.peers == {} and srv.events.empty()


async def test_a_stream_registers_only_the_peer_its_proof_named():
    async with ControlServer(PREFILL, FAST, cluster_secret=SECRET) as srv, grpc.aio.insecure_channel(
            f"127.0.0.1:{srv.port}") as channel:
        token = proof((await challenge(channel)).nonce, f"127.0.0.1:{srv.port}", client="decode-9")
        first = await raw_register(channel, token)
        assert (first.register_ack.accepted, first.register_ack.reason) == (
            False, "peer 'decode-0' registered on a stream authenticated as 'decode-9'")
        assert srv.peers == {} and srv.events.empty()


WRONG_LAYOUT = msgspec.structs.replace(DECODE, layout=msgspec.structs.replace(LAYOUT, block_size_tokens=32))


@pytest.mark.parametrize("secret, error, message", [
    ("other-secret", AuthenticationFailed, "refused the control stream: " + MISMATCH),
    (None, AuthenticationFailed, "refused the control stream: " + NO_SECRET),
    (SECRET, PeerRejected, "refused registration: page size mismatch: prefill block_size_tokens=16, "
                           "decode block_size_tokens=32"),
], ids=["wrong-secret", "no-secret", "right-secret"])
async def test_layout_details_reach_only_an_authenticated_decode(secret, error, message):
    """A decode whose layout differs learns the prefill's layout only once it proved the secret."""
    async with ControlServer(PREFILL, FAST, cluster_secret=SECRET) as srv:
        with pytest.raises(error) as exc:
            await ControlClient(f"127.0.0.1:{srv.port}", WRONG_LAYOUT, FAST, cluster_secret=secret).connect()
        assert str(exc.value) == f"prefill 127.0.0.1:{srv.port} {message}"


def test_status_translation_keeps_unset_first_token_unset():
    bare = TransferStatusMsg(room=2**63 - 1, state=TransferState.WAITING_FOR_INPUT)
    assert status_from_pb(status_to_pb(bare)) == bare
    full = TransferStatusMsg(room=1, state=TransferState.SUCCESS, first_token_id=0, first_token_logprob=0.0,
                             num_bytes=5, num_cached_tokens=48)
    assert status_from_pb(status_to_pb(full)) == full
    scored = TransferStatusMsg(room=1, state=TransferState.SUCCESS, first_token_id=7, first_token_logprob=-0.5,
                               first_token_top_logprobs=((7, -0.5),),
                               prompt_logprobs=(((5, -1.25), (9, -0.75)), ((6, -2.5),)), prompt_ranks=(2, 1))
    assert status_from_pb(status_to_pb(scored)) == scored
    assert [len(e.entries) for e in status_to_pb(scored).prompt_logprobs] == [2, 1]
    assert list(status_to_pb(scored).prompt_ranks) == [2, 1]
    assert status_from_pb(pb.TransferStatus(room=3, state=99)) == failed(3, "unknown transfer state 99")


def test_regenerating_the_proto_reproduces_the_committed_files(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (ROOT / "disagg" / "wire" / "kv_control_pb2.py").read_text().splitlines()[1]
    if gen.header().strip() != committed.strip():
        pytest.skip(f"installed grpcio-tools {gen.tools_version()} differs from the one that generated: {committed}")
    # In a child process: protoc's extension module must not load beside NIXL's bundled libraries.
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv_control_pb2.py", "kv_control_pb2.pyi", "kv_control_pb2_grpc.py"]
    assert gen.differences(tmp_path) == []


async def test_every_queued_event_calls_on_event_once():
    # The prefill role idles between engine steps; on_event is how a claim or a release wakes it.
    woken = []
    async with ControlServer(PREFILL, FAST, on_event=lambda: woken.append(server.events.qsize())) as server:
        async with ControlClient(f"127.0.0.1:{server.port}", DECODE, FAST) as cli:
            claim = asyncio.ensure_future(cli.claim("req-1"))
            for _ in range(100):
                if len(woken) == 2:
                    break
                await asyncio.sleep(0.01)
            assert woken == [1, 2]  # the peer, then the claim: each already queued when on_event ran
            assert [await server.events.get() for _ in range(2)][1] == LeaseMsg(request_id="req-1", peer_name="decode-0")
            claim.cancel()


class _ScriptedControl(pb_grpc.KVControlServicer):
    """Ends each Connect with the next (code, details) of `script`, as a prefill's stream could end."""

    def __init__(self, script: list[tuple[grpc.StatusCode, str]]):
        self.script = script
        self.num_calls = 0

    async def Challenge(self, request, context):  # noqa: N802 (gRPC method name)
        return pb.ChallengeReply(nonce=b"n" * 32, ttl_s=10.0)

    async def Connect(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        code, details = self.script[min(self.num_calls, len(self.script) - 1)]
        self.num_calls += 1
        await context.abort(code, details)
        yield  # unreachable: makes this a stream handler


async def scripted_control(script):
    servicer = _ScriptedControl(script)
    server = grpc.aio.server()
    pb_grpc.add_KVControlServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, servicer


async def test_a_stream_torn_down_under_the_client_is_retried_and_the_refusal_then_named():
    """The prefill's refusal can race the decode's first write and reach it as INTERNAL: connect tries
    again within its deadline and reports the refusal, not an unreachable prefill."""
    server, port, servicer = await scripted_control(
        [(grpc.StatusCode.INTERNAL, "RST_STREAM"), (grpc.StatusCode.UNAUTHENTICATED, MISMATCH)])
    try:
        with pytest.raises(AuthenticationFailed) as exc:
            await ControlClient(f"127.0.0.1:{port}", DECODE, FAST, cluster_secret="other-secret").connect()
        assert str(exc.value) == f"prefill 127.0.0.1:{port} refused the control stream: {MISMATCH}"
        assert servicer.num_calls == 2
    finally:
        await server.stop(None)


async def test_a_stream_that_keeps_failing_is_unavailable_at_the_deadline():
    server, port, servicer = await scripted_control([(grpc.StatusCode.INTERNAL, "RST_STREAM")])
    try:
        started = time.monotonic()
        with pytest.raises(PeerUnavailable) as exc:
            await ControlClient(f"127.0.0.1:{port}", DECODE, FAST).connect()
        assert str(exc.value) == f"cannot reach prefill 127.0.0.1:{port} within 2 s (INTERNAL)"
        assert 1.0 <= time.monotonic() - started < 3.0  # retried with backoff up to connect_timeout_s (2 s)
        assert servicer.num_calls >= 4  # 0.05, 0.1, 0.2, 0.4, 0.8 s apart
    finally:
        await server.stop(None)
