"""KVLayout, peer metadata, the compatibility check and the backend factory."""

from __future__ import annotations

import pytest

from kvtransfer.base import BackendUnavailable, IncompatiblePeer, InvalidLayout, KVLayout, LayoutMismatch
from kvtransfer.factory import available_backends, create_backend
from kvtransfer.handshake import PeerInfo, check_compatible, decode_peer_info, encode_peer_info

LAYOUT = KVLayout(base_address=4096, num_blocks=64, block_size_bytes=4096, block_size_tokens=16, dtype="bfloat16")


def test_for_cache_derives_bytes_per_block_from_the_engine_shape():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; K and V; 16 tokens per block.
    layout = KVLayout.for_cache(4096, 10, num_layers=30, block_size_tokens=16, num_kv_heads=3, head_dim=64,
                                dtype="bfloat16")
    assert layout.block_size_bytes == 30 * 2 * 16 * 3 * 64 * 2 == 368640
    assert layout.size_bytes == 3686400
    assert layout.block_address(2) == 4096 + 2 * 368640
    assert (layout.device, layout.device_id, layout.is_cuda) == ("cpu", 0, False)


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_blocks": 0}, "KVLayout.num_blocks must be a positive int, got 0"),
    ({"block_size_bytes": -1}, "KVLayout.block_size_bytes must be a positive int, got -1"),
    ({"dtype": ""}, "KVLayout.dtype must be a non-empty dtype name such as 'bfloat16'"),
    ({"device": "gpu0"}, "KVLayout.device must be 'cpu' or 'cuda:N', got 'gpu0'"),
])
def test_invalid_layouts_are_refused(changes, message):
    fields = dict(base_address=4096, num_blocks=64, block_size_bytes=4096, block_size_tokens=16, dtype="bfloat16")
    with pytest.raises(InvalidLayout) as excinfo:
        KVLayout(**{**fields, **changes})
    assert str(excinfo.value) == message


def test_unknown_dtype_in_for_cache():
    with pytest.raises(InvalidLayout, match="unknown KV dtype 'int3'"):
        KVLayout.for_cache(1, 1, num_layers=1, block_size_tokens=1, num_kv_heads=1, head_dim=1, dtype="int3")


def test_peer_info_round_trips():
    info = PeerInfo("tcp", "tcp-1", KVLayout(4096, 8, 512, 16, "float32", "cuda:1", 30), host="127.0.0.1", port=5)
    assert decode_peer_info(encode_peer_info(info), "tcp") == info


def test_metadata_of_another_backend_or_garbage_is_refused():
    metadata = encode_peer_info(PeerInfo("tcp", "tcp-1", LAYOUT))
    with pytest.raises(IncompatiblePeer, match="^peer 'tcp-1' uses the 'tcp' transfer backend, this worker uses 'nixl'$"):
        decode_peer_info(metadata, "nixl")
    with pytest.raises(IncompatiblePeer, match="^peer metadata is not kvtransfer metadata"):
        decode_peer_info(b"\x00garbage", "tcp")
    with pytest.raises(IncompatiblePeer, match="speaks kvtransfer protocol 9, this worker speaks 1"):
        decode_peer_info(encode_peer_info(PeerInfo("tcp", "tcp-1", LAYOUT, version=9)), "tcp")


def test_compatibility_names_the_first_difference_with_both_values():
    check_compatible(LAYOUT, "p", KVLayout(1 << 20, 16, 4096, 16, "bfloat16"))  # address, count may differ
    with pytest.raises(LayoutMismatch) as excinfo:
        check_compatible(LAYOUT, "p", KVLayout(4096, 64, 8192, 16, "float32"))
    assert str(excinfo.value) == "KV layout mismatch with peer 'p': dtype is 'float32' there and 'bfloat16' here"


def test_factory_names_the_available_backends():
    assert available_backends()[-2:] == ["tcp", "loopback"]
    with pytest.raises(BackendUnavailable) as excinfo:
        create_backend("ucx")
    assert str(excinfo.value) == f"unknown transfer backend 'ucx'; available backends: {', '.join(available_backends())}"


def test_nixl_missing_is_reported_with_the_alternatives(monkeypatch):
    import kvtransfer.nixl as nixl

    monkeypatch.setattr(nixl, "NIXL_MODULES", ("no_such_nixl._api",))
    assert not nixl.nixl_installed()
    with pytest.raises(BackendUnavailable, match=r"transfer backend 'nixl' is unavailable: .*available backends: tcp, loopback"):
        nixl.load_nixl()
