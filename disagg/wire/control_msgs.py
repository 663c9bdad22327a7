"""KV control-plane values (msgspec structs) and their translation to and from proto/kv_control.proto.

The gRPC layer (kvtransfer/control/) sends protobuf; everything on either side of it (prefill and
decode roles) sees only these frozen structs and the TransferState enum.
"""

from __future__ import annotations

import msgspec

from disagg.wire import kv_control_pb2 as pb
from disagg.wire.states import TransferState

_STATE_TO_PB = {
    TransferState.BOOTSTRAPPING: pb.TRANSFER_STATE_BOOTSTRAPPING,
    TransferState.WAITING_FOR_INPUT: pb.TRANSFER_STATE_WAITING_FOR_INPUT,
    TransferState.TRANSFERRING: pb.TRANSFER_STATE_TRANSFERRING,
    TransferState.SUCCESS: pb.TRANSFER_STATE_SUCCESS,
    TransferState.FAILED: pb.TRANSFER_STATE_FAILED,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


class KVLayoutMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Shape of a worker's paged KV cache (the numbers of kvtransfer.base.KVLayout, no address).

    `block_size_bytes` is one block of one TP rank across all layers, K and V; `num_kv_heads` is
    the model's, split over `tp_size` ranks. Peers with equal TP sizes agree on all but num_blocks;
    different TP sizes need the same model shape (kvtransfer/heads.py).
    """

    num_blocks: int
    block_size_tokens: int
    block_size_bytes: int
    dtype: str
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    tp_size: int = 1


class PeerMsg(msgspec.Struct, frozen=True, kw_only=True):
    """One worker as a control-plane peer: name, transfer backend metadata and KV layout."""

    peer_name: str
    transfer_backend: str
    layout: KVLayoutMsg
    agent_metadata: bytes = b""
    dp_rank: int = 0
    tp_rank: int = 0


class TransferInfoMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Decode -> prefill: the destination blocks reserved for one room."""

    room: int
    peer_name: str
    dst_block_ids: tuple[int, ...]
    dst_dp_rank: int = 0
    first_token_slot: int = -1  # -1: the first token travels in TransferStatusMsg only
    num_prompt_tokens: int = 0  # 0: unknown; else the blocks must hold this many tokens
    request_id: str = ""
    # The decode holds the KV of the prompt's first num_cached_tokens (whole blocks) already:
    # dst_block_ids are the blocks after them, and only those are sent.
    num_cached_tokens: int = 0
    traceparent: str = ""  # the decode request's W3C trace context (tracing on); "": none


class TransferStatusMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill -> decode: progress of one room; with SUCCESS comes the first sampled token."""

    room: int
    state: TransferState
    reason: str = ""
    first_token_id: int | None = None
    first_token_logprob: float | None = None
    num_bytes: int = 0
    first_token_top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), the top-n asked for
    # With SUCCESS, when asked for: per prompt token from the second on, its (token id, logprob)
    # pairs (the actual token's and the top-n); the first prompt token has none.
    prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()
    prompt_ranks: tuple[int, ...] = ()  # with them: each actual prompt token's rank, from the second on
    num_cached_tokens: int = 0  # with SUCCESS: the prompt tokens the prefill found in its prefix cache
    kv_digest: int = 0  # with SUCCESS and --kv-checksum: the digest of the blocks written (0: none)
    # Set by the decode's control client, never sent: the stream to the prefill broke, so the room
    # failed without the prefill's word (the peer is unavailable, not the request bad).
    peer_lost: bool = False


class AbortMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Decode -> prefill (via the control server's event queue): drop a room and free its blocks."""

    room: int
    reason: str
    peer_name: str


class LeaseMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Pull flow, decode -> prefill (via the control server's event queue): claim the leased
    blocks of a finished request (`release` False), or release them (`release` True)."""

    request_id: str
    peer_name: str
    release: bool = False
    reason: str = ""
    digest_blocks: tuple[int, int] = (0, 0)  # a release with --kv-checksum: (first, count) of the leased blocks read


class LeaseStatusMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Pull flow, prefill -> decode: the answer to a claim or a release."""

    request_id: str
    ok: bool
    reason: str = ""
    block_ids: tuple[int, ...] = ()
    released: bool = False
    peer_lost: bool = False  # as TransferStatusMsg.peer_lost: not ok because the stream broke
    kv_digest: int = 0  # the answer to a release that asked: the digest of the blocks read (0: none)


class PeerLostMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Control-server event: a decode peer's stream ended; its active rooms are dropped."""

    peer_name: str
    reason: str
    rooms: tuple[int, ...] = ()


def layout_to_pb(layout: KVLayoutMsg) -> pb.KVLayout:
    """KVLayoutMsg -> protobuf."""
    return pb.KVLayout(**msgspec.structs.asdict(layout))


def layout_from_pb(msg: pb.KVLayout) -> KVLayoutMsg:
    """protobuf -> KVLayoutMsg."""
    return KVLayoutMsg(
        num_blocks=msg.num_blocks, block_size_tokens=msg.block_size_tokens,
        block_size_bytes=msg.block_size_bytes, dtype=msg.dtype, num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads, head_dim=msg.head_dim, tp_size=msg.tp_size or 1,
    )


def peer_to_pb(peer: PeerMsg) -> pb.PeerInfo:
    """PeerMsg -> protobuf."""
    return pb.PeerInfo(
        peer_name=peer.peer_name, agent_metadata=peer.agent_metadata,
        transfer_backend=peer.transfer_backend, layout=layout_to_pb(peer.layout),
        dp_rank=peer.dp_rank, tp_rank=peer.tp_rank,
    )


def peer_from_pb(msg: pb.PeerInfo) -> PeerMsg:
    """protobuf -> PeerMsg."""
    return PeerMsg(
        peer_name=msg.peer_name, agent_metadata=bytes(msg.agent_metadata),
        transfer_backend=msg.transfer_backend, layout=layout_from_pb(msg.layout),
        dp_rank=msg.dp_rank, tp_rank=msg.tp_rank,
    )


def transfer_info_to_pb(info: TransferInfoMsg) -> pb.TransferInfo:
    """TransferInfoMsg -> protobuf."""
    return pb.TransferInfo(
        room=info.room, peer_name=info.peer_name, dst_block_ids=info.dst_block_ids,
        dst_dp_rank=info.dst_dp_rank, first_token_slot=info.first_token_slot,
        num_prompt_tokens=info.num_prompt_tokens, request_id=info.request_id,
        num_cached_tokens=info.num_cached_tokens, traceparent=info.traceparent,
    )


def transfer_info_from_pb(msg: pb.TransferInfo) -> TransferInfoMsg:
    """protobuf -> TransferInfoMsg."""
    return TransferInfoMsg(
        room=msg.room, peer_name=msg.peer_name, dst_block_ids=tuple(msg.dst_block_ids),
        dst_dp_rank=msg.dst_dp_rank, first_token_slot=msg.first_token_slot,
        num_prompt_tokens=msg.num_prompt_tokens, request_id=msg.request_id,
        num_cached_tokens=msg.num_cached_tokens, traceparent=msg.traceparent,
    )


def status_to_pb(status: TransferStatusMsg) -> pb.TransferStatus:
    """TransferStatusMsg -> protobuf (unset optional fields stay unset)."""
    msg = pb.TransferStatus(
        room=status.room, state=_STATE_TO_PB[status.state], reason=status.reason, num_bytes=status.num_bytes,
        num_cached_tokens=status.num_cached_tokens, kv_digest=status.kv_digest, prompt_ranks=status.prompt_ranks,
    )
    if status.first_token_id is not None:
        msg.first_token_id = status.first_token_id
    if status.first_token_logprob is not None:
        msg.first_token_logprob = status.first_token_logprob
    msg.first_token_top_logprobs.extend(pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in status.first_token_top_logprobs)
    msg.prompt_logprobs.extend(
        pb.PromptTokenLogprobs(entries=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in entry])
        for entry in status.prompt_logprobs)
    return msg


def status_from_pb(msg: pb.TransferStatus) -> TransferStatusMsg:
    """protobuf -> TransferStatusMsg; an unknown state reads as FAILED with a reason."""
    state = _STATE_FROM_PB.get(msg.state)
    reason = msg.reason if state is not None else f"unknown transfer state {msg.state}"
    return TransferStatusMsg(
        room=msg.room, state=state or TransferState.FAILED, reason=reason,
        first_token_id=msg.first_token_id if msg.HasField("first_token_id") else None,
        first_token_logprob=msg.first_token_logprob if msg.HasField("first_token_logprob") else None,
        num_bytes=msg.num_bytes,
        first_token_top_logprobs=tuple((x.token_id, x.logprob) for x in msg.first_token_top_logprobs),
        prompt_logprobs=tuple(tuple((x.token_id, x.logprob) for x in entry.entries) for entry in msg.prompt_logprobs),
        num_cached_tokens=msg.num_cached_tokens, kv_digest=msg.kv_digest, prompt_ranks=tuple(msg.prompt_ranks),
    )


def register_msg(peer: PeerMsg) -> pb.DecodeMsg:
    """The first message of a decode stream."""
    return pb.DecodeMsg(register_peer=pb.RegisterPeer(peer=peer_to_pb(peer)))


def register_ack_msg(accepted: bool, reason: str = "", peer: PeerMsg | None = None) -> pb.PrefillMsg:
    """The prefill's answer to RegisterPeer."""
    ack = pb.RegisterAck(accepted=accepted, reason=reason)
    if peer is not None:
        ack.peer.CopyFrom(peer_to_pb(peer))
    return pb.PrefillMsg(register_ack=ack)


def transfer_msg(info: TransferInfoMsg) -> pb.DecodeMsg:
    """Decode stream message carrying TransferInfo."""
    return pb.DecodeMsg(transfer_info=transfer_info_to_pb(info))


def status_msg(status: TransferStatusMsg) -> pb.PrefillMsg:
    """Prefill stream message carrying TransferStatus."""
    return pb.PrefillMsg(status=status_to_pb(status))


def abort_msg(room: int, reason: str) -> pb.DecodeMsg:
    """Decode stream message carrying Abort."""
    return pb.DecodeMsg(abort=pb.Abort(room=room, reason=reason))


def heartbeat_msg(seq: int) -> pb.DecodeMsg:
    """Decode stream heartbeat."""
    return pb.DecodeMsg(heartbeat=pb.Heartbeat(seq=seq))


def heartbeat_ack_msg(seq: int) -> pb.PrefillMsg:
    """Prefill stream answer to a heartbeat."""
    return pb.PrefillMsg(heartbeat_ack=pb.HeartbeatAck(seq=seq))


def claim_msg(request_id: str) -> pb.DecodeMsg:
    """Decode stream message carrying Claim (pull flow)."""
    return pb.DecodeMsg(claim=pb.Claim(request_id=request_id))


def release_msg(request_id: str, reason: str, digest_blocks: tuple[int, int] = (0, 0)) -> pb.DecodeMsg:
    """Decode stream message carrying Release (pull flow); `digest_blocks` (first, count) asks for a digest."""
    return pb.DecodeMsg(release=pb.Release(request_id=request_id, reason=reason, digest_first_block=digest_blocks[0],
                                           digest_num_blocks=digest_blocks[1]))


def lease_status_msg(status: LeaseStatusMsg) -> pb.PrefillMsg:
    """Prefill stream message carrying LeaseStatus."""
    return pb.PrefillMsg(lease_status=pb.LeaseStatus(
        request_id=status.request_id, ok=status.ok, reason=status.reason, block_ids=list(status.block_ids),
        released=status.released, kv_digest=status.kv_digest))


def lease_status_from_pb(msg: pb.LeaseStatus) -> LeaseStatusMsg:
    """protobuf -> LeaseStatusMsg."""
    return LeaseStatusMsg(request_id=msg.request_id, ok=msg.ok, reason=msg.reason, block_ids=tuple(msg.block_ids),
                          released=msg.released, kv_digest=msg.kv_digest)
