"""`--kv-events-config` end to end: the DP workers of a unified server (and of a P/D pair) publish vLLM's KVEventBatch over
ZMQ to a SUB socket of this test (bound on loopback: a non-wildcard endpoint is connected to, as in
vLLM), each worker on the endpoint's port + its rank; the replay socket resends kept batches."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
import zmq

from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.kv_events_config import parse_kv_events_config
from disagg.launch import start_server
from disagg.wire.kv_events import AllBlocksCleared, BlockStored, KVEventBatch, decode_batch
from pd_cluster import TINY, Cluster, pd_config

pytestmark = [pytest.mark.asyncio(loop_scope="function"), pytest.mark.timeout(60)]
A = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
B = [21, 22, 23, 24, 25, 26, 27, 28, 29]
RECV_TIMEOUT_MS = 10_000


def chain(tokens: list[int]) -> tuple[list[int], list[int]]:
    """The stored hashes of the prompt's full blocks (block_size 4), and their token ids: the
    engine's chain, computed here in another process (the hashes must not depend on the process)."""
    hashes, parent = [], 0
    for i in range(len(tokens) // 4):
        parent = hash((parent, tuple(tokens[i * 4 : i * 4 + 4])))
        hashes.append(parent)
    return hashes, tokens[: len(hashes) * 4]


def stored(tokens: list[int]) -> BlockStored:
    hashes, token_ids = chain(tokens)
    return BlockStored(hashes, None, token_ids, 4, None, "CPU")


def free_port_pair() -> int:
    """A port p with p and p + 1 both free on loopback (the second for DP rank 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two adjacent free ports")


class Subscriber:
    def __init__(self, ctx: zmq.Context, port: int, topic: bytes):
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.bind(f"tcp://127.0.0.1:{port}")

    def attach(self) -> None:
        """Let the socket take in the publishers that connected (it sends them its subscription only
        when it processes its commands, on a poll or a receive); until a publisher has the
        subscription it drops what it publishes, as ZMQ PUB does for any late joiner."""
        assert self.socket.poll(200) == 0

    def receive(self) -> tuple[bytes, int, KVEventBatch]:
        topic, seq, payload = self.socket.recv_multipart()
        return topic, int.from_bytes(seq, "big"), decode_batch(payload)


def replay(ctx: zmq.Context, port: int, start_seq: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
    out = []
    try:
        while True:
            empty, seq, payload = dealer.recv_multipart()  # zmq.Again past RCVTIMEO
            assert empty == b""
            out.append((int.from_bytes(seq, "big", signed=True), payload))
            if out[-1][0] == -1:
                return out
    finally:
        dealer.close()  # else ctx.term() would block on it


async def serve(dp_size: int, pub_port: int, replay_port: int):
    config = parse_kv_events_config(
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:{pub_port}", '
        f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}", "topic": "kv"}}')
    server = ServerConfig(port=0, dp_size=dp_size, load_balance_method="round_robin")
    return await start_server(server, TINY, DisaggConfig(), lambda _: None, kv_events=config)


async def generate(session, running, tokens: list[int], rank: int = 0) -> None:
    body = {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, "routed_dp_rank": rank}
    async with session.post(f"http://127.0.0.1:{running.port}/generate", json=body) as r:
        assert r.status == 200, await r.text()


async def test_one_worker_publishes_stored_and_cleared_and_replays_them():
    ctx = zmq.Context()
    pub_port, replay_port = free_port_pair(), free_port_pair()
    sub = Subscriber(ctx, pub_port, b"kv")
    running = await serve(1, pub_port, replay_port)
    sub.attach()
    try:
        async with aiohttp.ClientSession() as session:
            await generate(session, running, A)
            first = sub.receive()
            async with session.post(f"http://127.0.0.1:{running.port}/reset_prefix_cache") as r:
                assert r.status == 200
            second = sub.receive()
        assert first[:2] == (b"kv", 0)
        assert first[2].events == [stored(A)] and first[2].data_parallel_rank == 0
        assert second[:2] == (b"kv", 1)
        assert second[2].events == [AllBlocksCleared()] and second[2].data_parallel_rank == 0
        assert second[2].ts >= first[2].ts
        replayed = replay(ctx, replay_port, 1)
        assert [seq for seq, _ in replayed] == [1, -1]
        assert decode_batch(replayed[0][1]) == second[2] and replayed[1][1] == b""
        assert [seq for seq, _ in replay(ctx, replay_port, 0)] == [0, 1, -1]
    finally:
        await running.close()
        sub.socket.close(linger=0)
        ctx.term()


async def test_each_dp_worker_publishes_on_its_own_port_with_its_rank():
    ctx = zmq.Context()
    pub_port, replay_port = free_port_pair(), free_port_pair()
    subs = [Subscriber(ctx, pub_port + rank, b"kv") for rank in (0, 1)]
    running = await serve(2, pub_port, replay_port)
    for sub in subs:
        sub.attach()
    try:
        async with aiohttp.ClientSession() as session:
            await generate(session, running, A, rank=0)
            await generate(session, running, B, rank=1)
        got = [sub.receive() for sub in subs]
        assert [(topic, seq, batch.data_parallel_rank, batch.events) for topic, seq, batch in got] == [
            (b"kv", 0, 0, [stored(A)]), (b"kv", 0, 1, [stored(B)])]
        replayed = replay(ctx, replay_port + 1, 0)
        assert [seq for seq, _ in replayed] == [0, -1] and decode_batch(replayed[0][1]) == got[1][2]
    finally:
        await running.close()
        for sub in subs:
            sub.socket.close(linger=0)
        ctx.term()


async def test_prefill_and_decode_workers_publish_the_same_chain():
    """A P/D pair (dp 1 each): the prefill stores the prompt's blocks it computed, the decode the
    same blocks once their KV landed; both with the same hashes."""
    ctx = zmq.Context()
    ports = [(free_port_pair(), free_port_pair()) for _ in range(2)]
    subs = [Subscriber(ctx, pub_port, b"kv") for pub_port, _ in ports]
    disagg = pd_config("tcp")
    configs = [parse_kv_events_config(f'{{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:{pub}", '
                                      f'"replay_endpoint": "tcp://127.0.0.1:{rep}", "topic": "kv"}}') for pub, rep in ports]
    prefill, decode = await asyncio.gather(*(
        start_server(ServerConfig(port=0, disaggregation_mode=mode), TINY, disagg, lambda _: None, kv_events=config)
        for mode, config in zip(("prefill", "decode"), configs)))
    for sub in subs:
        sub.attach()
    cluster = Cluster(prefill, decode, aiohttp.ClientSession())
    try:
        body = cluster.pd_body({"input_ids": A, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        (p_status, _, _), (d_status, _, _) = await cluster.post_both("/generate", body, body)
        assert (p_status, d_status) == (200, 200)
        got = [sub.receive() for sub in subs]
        assert [(topic, seq, batch.data_parallel_rank, batch.events) for topic, seq, batch in got] == [
            (b"kv", 0, 0, [stored(A)]), (b"kv", 0, 0, [stored(A)])]
    finally:
        await cluster.close()
        for sub in subs:
            sub.socket.close(linger=0)
        ctx.term()
