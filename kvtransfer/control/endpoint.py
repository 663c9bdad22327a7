"""A worker's transfer endpoint: its backend with the engine's KV cache registered, and the
`PeerMsg` that introduces it on the control plane. Plain numbers in: kvtransfer never needs the engine."""

from __future__ import annotations

import uuid

from disagg.pd_config import TcpListenerConfig
from disagg.wire.control_msgs import KVLayoutMsg, PeerMsg
from kvtransfer.base import KVLayout, KVTransferBackend
from kvtransfer.factory import create_backend


def cache_layouts(*, base_address: int, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype: str, device: str, tp_size: int = 1) -> tuple[KVLayout, KVLayoutMsg]:
    """Layouts of `tp_size` [num_blocks, num_layers, 2, block_size, rank's kv heads, head_dim] caches
    back to back (`num_kv_heads`: the model's)."""
    layout = KVLayout.for_cache(base_address, num_blocks, num_layers=num_layers, block_size_tokens=block_size,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device, tp_size=tp_size)
    msg = KVLayoutMsg(num_blocks=num_blocks, block_size_tokens=block_size, block_size_bytes=layout.block_size_bytes,
                      dtype=dtype, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, tp_size=tp_size)
    return layout, msg


def open_endpoint(role: str, dp_rank: int, backend_name: str, host: str, cache: dict,
                  cluster_secret: str | None = None,
                  tcp_listener: TcpListenerConfig = TcpListenerConfig()) -> tuple[KVTransferBackend, PeerMsg]:
    """A backend named `<role>-<random>-dp<rank>` with the cache (fields of the engine's CacheSpec)
    registered once, and the PeerMsg carrying its metadata and layout. The caller closes the backend."""
    backend = create_backend(backend_name, agent_name=f"{role}-{uuid.uuid4().hex[:8]}-dp{dp_rank}", host=host,
                             cluster_secret=cluster_secret, tcp_listener=tcp_listener)
    try:
        layout, layout_msg = cache_layouts(**cache)
        backend.register(layout)
        peer = PeerMsg(peer_name=backend.agent_name, transfer_backend=backend.backend_name, layout=layout_msg,
                       agent_metadata=backend.peer_metadata(), dp_rank=dp_rank)
    except BaseException:
        backend.close()
        raise
    return backend, peer
