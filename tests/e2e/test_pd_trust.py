"""P/D under a cluster secret, end to end (real workers, real HTTP, tcp KV transfers): the output equals
the unified server's; a decode holding another secret, a bootstrap host not allowed, a foreign bootstrap
server and a decode peer the prefill cannot reach all end with a clear error, never a hang, and free
every block."""

import asyncio
import os
import re
import signal
import socket
import time

import aiohttp
import grpc
import pytest
import pytest_asyncio
from aiohttp import web
from cli_process import ready_url, start_cli

from bootstrap.client import BootstrapClient
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from disagg.wire import kv_control_pb2 as pb
from disagg.wire import kv_control_pb2_grpc as pb_grpc
from disagg.wire.auth import format_address
from disagg.wire.auth import CONTROL, CONTROL_AUTH_KEY, Binding, answer
from disagg.wire.control_msgs import KVLayoutMsg, PeerMsg, TransferInfoMsg, TransferState, register_msg
from kvtransfer.base import KVLayout
from kvtransfer.control.client import ControlClient
from kvtransfer.handshake import PeerInfo, encode_peer_info
from pd_cluster import counting_listener, pd_config, start_decode, start_pd

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
SECRET = "e2e-cluster-secret"
GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = "The quick brown fox jumps over the lazy dog, twice: " * 2  # > 100 tokens: chunked prefill
INTERNAL = "internal-only text: db password hunter2"
START = ([96, 96], [96, 96])  # free blocks per DP worker, prefill and decode


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster():
    c = await start_pd("tcp", cluster_secret=SECRET, decode_options={"allowed_bootstrap_hosts": ("127.0.0.1",)})
    yield c
    await c.close()


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
async def test_pd_with_a_cluster_secret_equals_unified(cluster, unified, path):
    if path == "/generate":
        body = {"text": LONG, "sampling_params": {"max_new_tokens": 12, **GREEDY}}
    else:
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 12, **GREEDY}
    pd = cluster.pd_body(body)
    (p_status, _, _), (d_status, d_data, _) = await cluster.post_both(path, pd, pd)
    assert (p_status, d_status) == (200, 200), d_data
    async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{unified.port}{path}", json=body) as r:
        expected = await r.json()
    if path == "/generate":
        assert d_data["output_ids"] == expected["output_ids"] and len(expected["output_ids"]) == 12
    else:
        assert d_data["choices"][0]["text"] == expected["choices"][0]["text"]
    assert await cluster.settled(START) == START


async def test_a_bootstrap_host_not_allowed_is_400_before_any_connection(cluster):
    async with counting_listener() as (port, accepted):
        # "localhost" is not in the list as written (no DNS resolution), though it names this host.
        body = dict(cluster.pd_body({"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
                    bootstrap_host="localhost", bootstrap_port=port)
        status, data, _ = await cluster.post(cluster.decode_url + "/generate", body, None)
    assert (status, data) == (400, {"error": {
        "message": f"bootstrap_host:bootstrap_port 'localhost:{port}' is not allowed on this decode server "
                   "(see its --allowed-bootstrap-hosts)",
        "type": "BadRequestError", "param": "bootstrap_host", "code": None}})
    assert accepted == []
    assert await cluster.settled(START) == START


async def test_an_entry_with_a_port_allows_that_registry_and_no_other_port_of_its_host(cluster):
    """`127.0.0.1:P` (P: the prefill's registry): a request naming another port of that host, and a pull
    ticket naming one, are refused before any connection; a request naming P is served."""
    registry_port = cluster.prefill.bootstrap_port
    decode = await start_decode(pd_config("tcp", cluster_secret=SECRET,
                                          allowed_bootstrap_hosts=(f"127.0.0.1:{registry_port}",)), dp_size=1)
    decode_url = f"http://127.0.0.1:{decode.port}"
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, **GREEDY}}
    try:
        async with counting_listener() as (port, accepted):
            ticket = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_host": "127.0.0.1",
                      "remote_port": port, "remote_request_id": "p-1", "remote_block_ids": [0]}
            push = await cluster.post(decode_url + "/generate", dict(cluster.pd_body(body), bootstrap_port=port), None)
            pull = await cluster.post(decode_url + "/v1/completions", {
                "model": "tiny", "prompt": "hi", "max_tokens": 2, "kv_transfer_params": ticket}, None)
            pd = cluster.pd_body(body)
            served = await asyncio.gather(cluster.post(cluster.prefill_url + "/generate", pd, None),
                                          cluster.post(decode_url + "/generate", pd, None))
        assert (push[0], push[1]["error"]) == (400, {
            "message": f"bootstrap_host:bootstrap_port '127.0.0.1:{port}' is not allowed on this decode server "
                       "(see its --allowed-bootstrap-hosts)", "type": "BadRequestError", "param": "bootstrap_host",
            "code": None})
        assert (pull[0], pull[1]["error"]) == (400, {
            "message": f"kv_transfer_params remote_host:remote_port '127.0.0.1:{port}' is not allowed on this decode "
                       "server (see its --allowed-bootstrap-hosts)", "type": "BadRequestError",
            "param": "kv_transfer_params", "code": None})
        assert [leg[0] for leg in served] == [200, 200] and len(served[1][1]["output_ids"]) == 2
        assert accepted == []
        assert await cluster.settled(START) == START
        assert await decode_free_blocks(decode) == [96]
    finally:
        await decode.close()


async def test_a_foreign_bootstrap_server_is_named_never_echoed(cluster):
    async def route(request):
        return web.Response(status=404, text=INTERNAL)

    app = web.Application()
    app.router.add_get("/route", route)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        body = dict(cluster.pd_body({"text": "hi", "sampling_params": {"max_new_tokens": 2}}), bootstrap_port=port)
        status, data, _ = await cluster.post(cluster.decode_url + "/generate", body, None)
    finally:
        await runner.cleanup()
    assert (status, data["error"]["message"]) == (
        500, f"BootstrapRejected: bootstrap server 127.0.0.1:{port} answered 404 to GET /route")
    assert await cluster.settled(START) == START


async def decode_free_blocks(decode) -> list[int]:
    return [w.num_free_blocks for w in await decode.controller.call_utility("stats")]


async def test_a_decode_with_another_secret_fails_fast_and_frees_both_sides(cluster):
    other = await start_decode(pd_config("tcp", cluster_secret="another-secret"), dp_size=1)
    router = RouterServer(RouterConfig(
        host="127.0.0.1", port=0, health_check_interval_s=0, request_timeout_s=60,
        prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),),
        decode=(f"http://127.0.0.1:{other.port}",)))
    try:
        await router.start()
        started = time.monotonic()
        body = {"text": LONG, "sampling_params": {"max_new_tokens": 4, **GREEDY}}
        async with cluster.session.post(router.url + "/generate", json=body) as r:
            status, data = r.status, await r.json()
        elapsed = time.monotonic() - started
        message = data["error"]["message"]
        assert status == 500 and elapsed < 10, (status, elapsed)  # the prefill's bootstrap timeout is 30 s
        assert re.fullmatch(r"AuthenticationFailed: prefill 127\.0\.0\.1:\d+ refused the control stream: cluster "
                            r"secret mismatch: the decode's --cluster-secret differs from the prefill's", message)
        assert await cluster.settled(START) == START  # the router cancelled the prefill leg; the prefill freed its blocks
        assert await decode_free_blocks(other) == [96]
    finally:
        await router.close()
        await other.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # bound, never listening: connections are refused


async def test_a_decode_peer_the_prefill_cannot_reach_fails_its_room_not_the_worker(cluster):
    """A decode (holding the secret) registers a KV listener that refuses connections: its room fails
    with the reason, and the prefill worker goes on serving."""
    room = 2 * 4242  # follow_bootstrap_room: prefill DP rank 0
    layout = KVLayout(4096, 96, 2048, 4, "float32", num_layers=2)
    metadata = encode_peer_info(PeerInfo("tcp", "rogue-decode", layout, host="127.0.0.1", port=closed_port()))
    peer = PeerMsg(peer_name="rogue-decode", transfer_backend="tcp", agent_metadata=metadata, layout=KVLayoutMsg(
        num_blocks=96, block_size_tokens=4, block_size_bytes=2048, dtype="float32", num_layers=2))
    async with BootstrapClient("127.0.0.1", cluster.prefill.bootstrap_port) as boot:
        address = await boot.get_rank_address(0)
    body = cluster.pd_body({"text": "rogue " * 4, "sampling_params": {"max_new_tokens": 2, **GREEDY}}, room)
    async with ControlClient(format_address(address.rank_ip, address.rank_port), peer,
                             cluster_secret=SECRET) as client:
        leg = asyncio.create_task(cluster.post(cluster.prefill_url + "/generate", body, None))
        status = await asyncio.wait_for(client.send_transfer(TransferInfoMsg(
            room=room, peer_name="rogue-decode", dst_block_ids=(1, 2, 3, 4, 5, 6, 7), num_prompt_tokens=25)), 30)
        p_status, p_data, _ = await leg
    assert status.state is TransferState.FAILED
    assert status.reason.startswith("decode peer rogue-decode could not be added: cannot connect to peer "
                                    "'rogue-decode' at 127.0.0.1:")
    assert (p_status, p_data["error"]["message"]) == (500, status.reason)
    assert await cluster.settled(START) == START
    assert all(w.alive for w in cluster.prefill.controller.worker_states())
    pd = cluster.pd_body({"text": "still here", "sampling_params": {"max_new_tokens": 2, **GREEDY}}, room + 2)
    (p_ok, _, _), (d_ok, _, _) = await cluster.post_both("/generate", pd, pd)
    assert (p_ok, d_ok) == (200, 200)


def rogue_peer(port: int) -> PeerMsg:
    """A decode peer whose KV listener is 127.0.0.1:port (a listener an attacker would name)."""
    layout = KVLayout(4096, 96, 2048, 4, "float32", num_layers=2)
    metadata = encode_peer_info(PeerInfo("tcp", "rogue-decode", layout, host="127.0.0.1", port=port))
    return PeerMsg(peer_name="rogue-decode", transfer_backend="tcp", agent_metadata=metadata, layout=KVLayoutMsg(
        num_blocks=96, block_size_tokens=4, block_size_bytes=2048, dtype="float32", num_layers=2))


async def refusal_of_replay(stub, token: str, peer: PeerMsg) -> tuple:
    """(code, details) that end a Connect carrying `token` and registering `peer`. A refusal can race
    our write and reach us as INTERNAL (docs/protocol.md): that attempt is replayed again, as a decode
    retries it."""
    for _ in range(20):
        call = stub.Connect(metadata=((CONTROL_AUTH_KEY, token),))
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await call.write(register_msg(peer))
            await asyncio.wait_for(call.read(), 10)
        if exc.value.code() is not grpc.StatusCode.INTERNAL:
            return exc.value.code(), exc.value.details()
    raise AssertionError("every attempt ended INTERNAL")


async def test_a_replayed_control_proof_never_makes_the_prefill_connect_anywhere(cluster):
    """A proof captured once and sent again 4 times to a real prefill worker: each replay is refused
    before its registration is read, and the listener the replays name is never contacted."""
    accepted = []
    listener = await asyncio.start_server(lambda r, w: accepted.append(w.close()), "127.0.0.1", 0)
    async with BootstrapClient("127.0.0.1", cluster.prefill.bootstrap_port) as boot:
        address = await boot.get_rank_address(0)
    target = format_address(address.rank_ip, address.rank_port)
    async with listener, grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.KVControlStub(channel)
        nonce = (await stub.Challenge(pb.ChallengeRequest())).nonce
        token = answer(SECRET, CONTROL, Binding(nonce, os.urandom(32), "rogue-decode", target))
        first = stub.Connect(metadata=((CONTROL_AUTH_KEY, token),))
        await first.write(register_msg(rogue_peer(closed_port())))
        assert (await asyncio.wait_for(first.read(), 10)).register_ack.accepted
        named = rogue_peer(listener.sockets[0].getsockname()[1])
        for _ in range(4):
            assert await refusal_of_replay(stub, token, named) == (
                grpc.StatusCode.UNAUTHENTICATED,
                "cluster secret proof was already used: this prefill accepts each answer once")
        await asyncio.sleep(0.5)  # what a registration would have triggered at once
        first.cancel()
    assert accepted == []
    assert await cluster.settled(START) == START


async def test_disagg_serve_hands_one_secret_to_every_part_and_guards_the_router_and_admin_routes():
    env = dict(os.environ)
    env.pop("DISAGG_CLUSTER_SECRET", None)  # none given: serve draws one
    proc, lines = await start_cli("serve", "--model", "tiny", "--dtype", "float32", "--port", "0", "--dp-size", "1",
                                  "--transfer-backend", "tcp", "--api-key", "api-1", "--admin-key", "admin-1", env=env)
    try:
        router = ready_url(lines)
        prefill, bootstrap_port, decode = re.search(
            r"prefill (\S+) \(bootstrap (\d+)\), decode (\S+)", "".join(lines)).groups()
        body = {"text": "hi", "sampling_params": {"max_new_tokens": 3, **GREEDY}}
        async with aiohttp.ClientSession() as http:
            async with http.post(router + "/generate", json=body) as r:
                assert r.status == 401
            async with http.post(router + "/generate", json=body, headers={"Authorization": "Bearer api-1"}) as r:
                assert (r.status, len((await r.json())["output_ids"])) == (200, 3)
            for key, status in (("api-1", 401), ("admin-1", 200)):
                async with http.post(decode + "/flush_cache", headers={"Authorization": f"Bearer {key}"}) as r:
                    assert r.status == status
            registry = f"http://127.0.0.1:{bootstrap_port}"
            async with http.post(registry + "/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 0}) as r:
                assert r.status == 401  # the registry holds the secret serve drew
    finally:
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
