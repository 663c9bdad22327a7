"""Peer metadata: what one endpoint tells another, and the compatibility check at add_peer().

Encoded with msgspec msgpack (no pickle between processes). The layout travels with it so page-size,
dtype and block-size mismatches are refused before any byte moves.
"""

from __future__ import annotations

import msgspec

from kvtransfer.base import IncompatiblePeer, KVLayout, LayoutMismatch
from kvtransfer.heads import layout_mismatch

PROTOCOL_VERSION = 1  # a layout without heads or TP size (an older peer) decodes as TP 1


class PeerInfo(msgspec.Struct, frozen=True):
    """One endpoint's handshake message."""

    backend: str  # "nixl", "tcp", "loopback"
    name: str  # unique endpoint name
    layout: KVLayout
    host: str = ""  # tcp: where the endpoint listens
    port: int = 0
    agent_metadata: bytes = b""  # nixl: nixl_agent.get_agent_metadata()
    version: int = PROTOCOL_VERSION


def encode_peer_info(info: PeerInfo) -> bytes:
    return msgspec.msgpack.encode(info)


def decode_peer_info(metadata: bytes, backend: str) -> PeerInfo:
    """Decode a peer's metadata, refusing other backends' and other protocol versions' metadata."""
    try:
        info = msgspec.msgpack.decode(metadata, type=PeerInfo)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise IncompatiblePeer(f"peer metadata is not kvtransfer metadata: {exc}") from None
    if info.backend != backend:
        raise IncompatiblePeer(
            f"peer {info.name!r} uses the {info.backend!r} transfer backend, this worker uses {backend!r}"
        )
    if info.version != PROTOCOL_VERSION:
        raise IncompatiblePeer(
            f"peer {info.name!r} speaks kvtransfer protocol {info.version}, this worker speaks {PROTOCOL_VERSION}"
        )
    return info


def check_compatible(local: KVLayout, peer: str, remote: KVLayout) -> None:
    """Raise LayoutMismatch naming the field and both values when the two caches cannot exchange
    blocks (kvtransfer/heads.py: equal blocks, or the same model shape under different TP sizes)."""
    mismatch = layout_mismatch(local, remote)
    if mismatch:
        raise LayoutMismatch(f"KV layout mismatch with peer {peer!r}: {mismatch.field} is {mismatch.theirs!r} there "
                             f"and {mismatch.ours!r} here")
