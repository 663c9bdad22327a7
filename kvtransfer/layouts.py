"""The KV layout of an engine's cache as the two seams see it: the backend's KVLayout and the
control plane's KVLayoutMsg. Plain numbers in, so kvtransfer never needs the engine."""

from __future__ import annotations

from disagg.wire.control_msgs import KVLayoutMsg
from kvtransfer.base import KVLayout


def cache_layouts(*, base_address: int, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype: str, device: str) -> tuple[KVLayout, KVLayoutMsg]:
    """Layouts of a [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] cache."""
    layout = KVLayout.for_cache(base_address, num_blocks, num_layers=num_layers, block_size_tokens=block_size,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device)
    msg = KVLayoutMsg(num_blocks=num_blocks, block_size_tokens=block_size, block_size_bytes=layout.block_size_bytes,
                      dtype=dtype, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
    return layout, msg
