# Generated from proto/ by scripts/gen_proto.py with grpcio-tools 1.85.1. Do not edit.
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_BOOTSTRAPPING: _ClassVar[TransferState]
    TRANSFER_STATE_WAITING_FOR_INPUT: _ClassVar[TransferState]
    TRANSFER_STATE_TRANSFERRING: _ClassVar[TransferState]
    TRANSFER_STATE_SUCCESS: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_BOOTSTRAPPING: TransferState
TRANSFER_STATE_WAITING_FOR_INPUT: TransferState
TRANSFER_STATE_TRANSFERRING: TransferState
TRANSFER_STATE_SUCCESS: TransferState
TRANSFER_STATE_FAILED: TransferState

class ChallengeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("nonce", "ttl_s")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    ttl_s: float
    def __init__(self, nonce: _Optional[bytes] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_blocks", "block_size_tokens", "block_size_bytes", "dtype", "num_layers", "num_kv_heads", "head_dim", "tp_size")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size_tokens: int
    block_size_bytes: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_size_tokens: _Optional[int] = ..., block_size_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("peer_name", "agent_metadata", "transfer_backend", "layout", "dp_rank", "tp_rank")
    PEER_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    peer_name: str
    agent_metadata: bytes
    transfer_backend: str
    layout: KVLayout
    dp_rank: int
    tp_rank: int
    def __init__(self, peer_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., transfer_backend: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., dp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class RegisterPeer(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: PeerInfo
    def __init__(self, peer: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class RegisterAck(_message.Message):
    __slots__ = ("accepted", "reason", "peer")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    peer: PeerInfo
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., peer: _Optional[_Union[PeerInfo, _Mapping]] = ...) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("room", "peer_name", "dst_block_ids", "dst_dp_rank", "first_token_slot", "num_prompt_tokens", "request_id", "num_cached_tokens", "traceparent")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PEER_NAME_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    room: int
    peer_name: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_dp_rank: int
    first_token_slot: int
    num_prompt_tokens: int
    request_id: str
    num_cached_tokens: int
    traceparent: str
    def __init__(self, room: _Optional[int] = ..., peer_name: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., dst_dp_rank: _Optional[int] = ..., first_token_slot: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("room", "state", "reason", "first_token_id", "first_token_logprob", "num_bytes", "first_token_top_logprobs", "prompt_logprobs", "num_cached_tokens", "kv_digest", "prompt_ranks")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_RANKS_FIELD_NUMBER: _ClassVar[int]
    room: int
    state: TransferState
    reason: str
    first_token_id: int
    first_token_logprob: float
    num_bytes: int
    first_token_top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptTokenLogprobs]
    num_cached_tokens: int
    kv_digest: int
    prompt_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, room: _Optional[int] = ..., state: _Optional[_Union[TransferState, str]] = ..., reason: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., num_bytes: _Optional[int] = ..., first_token_top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptTokenLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., kv_digest: _Optional[int] = ..., prompt_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptTokenLogprobs(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("room", "reason")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    room: int
    reason: str
    def __init__(self, room: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Claim(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("request_id", "reason", "digest_first_block", "digest_num_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    DIGEST_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    digest_first_block: int
    digest_num_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., digest_first_block: _Optional[int] = ..., digest_num_blocks: _Optional[int] = ...) -> None: ...

class LeaseStatus(_message.Message):
    __slots__ = ("request_id", "ok", "reason", "block_ids", "released", "kv_digest")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_DIGEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    reason: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    released: bool
    kv_digest: int
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., released: _Optional[bool] = ..., kv_digest: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("seq",)
    SEQ_FIELD_NUMBER: _ClassVar[int]
    seq: int
    def __init__(self, seq: _Optional[int] = ...) -> None: ...

class DecodeMsg(_message.Message):
    __slots__ = ("register_peer", "transfer_info", "abort", "heartbeat", "claim", "release")
    REGISTER_PEER_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_INFO_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    register_peer: RegisterPeer
    transfer_info: TransferInfo
    abort: Abort
    heartbeat: Heartbeat
    claim: Claim
    release: Release
    def __init__(self, register_peer: _Optional[_Union[RegisterPeer, _Mapping]] = ..., transfer_info: _Optional[_Union[TransferInfo, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., claim: _Optional[_Union[Claim, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ...) -> None: ...

class PrefillMsg(_message.Message):
    __slots__ = ("register_ack", "status", "heartbeat_ack", "lease_status")
    REGISTER_ACK_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    LEASE_STATUS_FIELD_NUMBER: _ClassVar[int]
    register_ack: RegisterAck
    status: TransferStatus
    heartbeat_ack: HeartbeatAck
    lease_status: LeaseStatus
    def __init__(self, register_ack: _Optional[_Union[RegisterAck, _Mapping]] = ..., status: _Optional[_Union[TransferStatus, _Mapping]] = ..., heartbeat_ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., lease_status: _Optional[_Union[LeaseStatus, _Mapping]] = ...) -> None: ...
