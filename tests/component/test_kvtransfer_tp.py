"""KV blocks between caches of different TP sizes over every backend: each destination rank ends up
holding exactly its heads of the source blocks, the bytes moved are one copy of what it needs, and
every other byte stays as it was."""

from __future__ import annotations

import numpy as np
import pytest

from kvtransfer import descriptors
from kvtransfer.base import KVLayout, wait
from kvtransfer.factory import create_backend
from kvtransfer.heads import rank_heads
from kvtransfer.loopback import LoopbackFabric
from kvtransfer.nixl import nixl_installed

pytestmark = pytest.mark.timeout(60)

LAYERS, TOKENS, HEAD_DIM = 2, 4, 8
BACKENDS = ["loopback", "tcp",
            pytest.param("nixl", marks=pytest.mark.skipif(not nixl_installed(), reason="NIXL is not installed"))]


class Cache:
    """`tp` ranks' [blocks, layers, 2, tokens, local heads, head_dim] float32 caches back to back."""

    def __init__(self, heads: int, tp: int, num_blocks: int):
        self.heads, self.tp = heads, tp
        local = rank_heads(heads, tp, 0)[1] - rank_heads(heads, tp, 0)[0]
        self.array = np.zeros((tp, num_blocks, LAYERS, 2, TOKENS, local, HEAD_DIM), dtype=np.float32)
        self.layout = KVLayout.for_cache(self.array.ctypes.data, num_blocks, num_layers=LAYERS, block_size_tokens=TOKENS,
                                         num_kv_heads=heads, head_dim=HEAD_DIM, dtype="float32", tp_size=tp)

    def fill(self, seed: int) -> None:
        """Every element a value of (block, layer, K/V, token, global head, dim): replicas agree."""
        for rank in range(self.tp):
            start, end = rank_heads(self.heads, self.tp, rank)
            idx = np.indices(self.array.shape[1:]).astype(np.float32)
            value = seed + idx[0] * 1e4 + idx[1] * 1e3 + idx[2] * 500 + idx[3] * 100 + (idx[4] + start) * 10 + idx[5] * 0.1
            self.array[rank] = value

    def heads_of(self, block: int) -> np.ndarray:
        """[layers, 2, tokens, heads, head_dim] of one block, each head from a rank holding it."""
        out = np.empty((LAYERS, 2, TOKENS, self.heads, HEAD_DIM), dtype=np.float32)
        for rank in range(self.tp):
            start, end = rank_heads(self.heads, self.tp, rank)
            out[:, :, :, start:end] = self.array[rank, block]
        return out


@pytest.fixture(params=["whole", "staged in runs of 64 bytes"])
def staging(request, monkeypatch):
    """The tcp listener takes a frame of many small ranges through a bounded staging buffer: the
    bound forced down, every such frame takes many runs."""
    if request.param != "whole":
        monkeypatch.setattr(descriptors, "STAGING_BYTES", 64)


def pair(kind: str):
    fabric = LoopbackFabric()
    return create_backend(kind, fabric=fabric), create_backend(kind, fabric=fabric)


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("heads,src_tp,dst_tp", [(4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 1, 4), (4, 4, 2), (2, 4, 1), (2, 1, 4)])
def test_head_slices_land_on_their_ranks(kind, op, heads, src_tp, dst_tp):
    move_and_check(kind, op, heads, src_tp, dst_tp)


@pytest.mark.skipif(not nixl_installed(), reason="nixl not installed")
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("heads,src_tp,dst_tp", [(4, 1, 2), (4, 2, 1), (4, 4, 2), (2, 4, 1), (2, 1, 4)])
def test_nixl_device_path_moves_one_descriptor_per_head_slice(monkeypatch, op, heads, src_tp, dst_tp):
    """What NIXL does between GPU caches of different TP sizes (one descriptor per head slice, no
    staging), run here on host memory: the same exact placement as the staged path."""
    from kvtransfer.nixl import NixlBackend

    monkeypatch.setattr(NixlBackend, "_per_slice", staticmethod(lambda local, remote: True))
    monkeypatch.setattr("kvtransfer.nixl._StagedXfer.post", _no_staging)
    move_and_check("nixl", op, heads, src_tp, dst_tp)


def _no_staging(*args, **kwargs):
    raise AssertionError("the per-slice path staged")


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("heads,src_tp,dst_tp", [(4, 2, 2), (4, 1, 2), (2, 4, 1)])
def test_tcp_listener_stages_many_small_ranges_in_bounded_runs(staging, op, heads, src_tp, dst_tp):
    # 20 blocks apart from each other: a frame of 20 ranges or more, each a 512- to 1024-byte block
    move_and_check("tcp", op, heads, src_tp, dst_tp, list(range(0, 40, 2)), list(range(41, 1, -2)))


def move_and_check(kind: str, op: str, heads: int, src_tp: int, dst_tp: int,
                   src_ids: list[int] = (5, 0, 1), dst_ids: list[int] = (2, 3, 0)) -> None:
    src, dst = Cache(heads, src_tp, num_blocks=max(src_ids) + 1), Cache(heads, dst_tp, num_blocks=max(dst_ids) + 2)
    src.fill(seed=7)
    a, b = pair(kind)
    try:
        a.register(src.layout)
        b.register(dst.layout)
        if op == "write":  # the source side posts
            peer = a.add_peer(b.peer_metadata())
            b.add_peer(a.peer_metadata())
            handle = a.write(peer, src_ids, dst_ids, b"tag")
            status = wait(a, handle, 10.0)
        else:  # the destination side reads
            a.add_peer(b.peer_metadata())
            peer = b.add_peer(a.peer_metadata())
            handle = b.read(peer, dst_ids, src_ids, b"tag")
            status = wait(b, handle, 10.0)
        assert status.ok, status.reason
    finally:
        a.close()
        b.close()
    local_heads = rank_heads(heads, dst_tp, 0)[1] - rank_heads(heads, dst_tp, 0)[0]
    assert handle.num_bytes == len(src_ids) * dst_tp * LAYERS * 2 * TOKENS * local_heads * HEAD_DIM * 4
    for s, d in zip(src_ids, dst_ids):
        want = src.heads_of(s)
        for rank in range(dst_tp):
            start, end = rank_heads(heads, dst_tp, rank)
            np.testing.assert_array_equal(dst.array[rank, d], want[:, :, :, start:end])
    untouched = [i for i in range(dst.array.shape[1]) if i not in dst_ids]
    assert not dst.array[:, untouched].any()
