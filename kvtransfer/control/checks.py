"""Checks the prefill's control server applies to a decode's registration and TransferInfo. Pure."""

from __future__ import annotations

from disagg.wire.control_msgs import PeerMsg, TransferInfoMsg
from kvtransfer.heads import layout_mismatch

_LABELS = {"block_size_tokens": "page size", "dtype": "kv cache dtype"}


def check_peer(local: PeerMsg, peer: PeerMsg) -> str | None:
    """Why `peer` cannot register with the `local` prefill worker, or None if it can."""
    if not peer.peer_name:
        return "peer_name must not be empty"
    if peer.layout.num_blocks <= 0:
        return f"num_blocks must be positive, got {peer.layout.num_blocks}"
    if peer.transfer_backend != local.transfer_backend:
        return f"transfer backend mismatch: prefill uses {local.transfer_backend!r}, decode uses {peer.transfer_backend!r}"
    mismatch = layout_mismatch(local.layout, peer.layout)
    if mismatch is None:
        return None
    name = mismatch.field
    return f"{_LABELS.get(name, name)} mismatch: prefill {name}={mismatch.ours}, decode {name}={mismatch.theirs}"


def check_transfer(info: TransferInfoMsg, peer: PeerMsg) -> str | None:
    """Why `info` cannot be applied to the registered `peer`'s KV cache, or None if it can."""
    ids, num_blocks = info.dst_block_ids, peer.layout.num_blocks
    if not ids:
        return f"room {info.room}: no destination block ids"
    seen: set[int] = set()
    for block_id in ids:
        if not 0 <= block_id < num_blocks:
            return (f"room {info.room}: destination block id {block_id} is out of range "
                    f"[0, {num_blocks}) of peer {peer.peer_name!r}")
        if block_id in seen:
            return f"room {info.room}: destination block id {block_id} appears twice"
        seen.add(block_id)
    page = peer.layout.block_size_tokens
    cached = info.num_cached_tokens
    if cached % page:
        return f"room {info.room}: num_cached_tokens {cached} is not a whole number of {page}-token pages"
    if info.num_prompt_tokens and cached >= info.num_prompt_tokens:
        return (f"room {info.room}: num_cached_tokens {cached} leaves nothing of the "
                f"{info.num_prompt_tokens}-token prompt to send")
    capacity = len(ids) * page
    if info.num_prompt_tokens - cached > capacity:
        held = f" after the {cached} the decode holds" if cached else ""
        return (f"room {info.room}: {len(ids)} destination blocks hold {capacity} tokens, "
                f"the prompt has {info.num_prompt_tokens - cached}{held}")
    return None
