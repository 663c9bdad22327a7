"""Messages between an HTTP front process and its DP engine worker processes (msgspec, msgpack).

One tagged union each way, so a reader decodes any message with one call. Plain values only:
workers tokenize, detokenize and apply chat templates; the front never needs torch.
"""

from __future__ import annotations

import enum

import msgspec

from disagg.types import ErrorCode, FinishReason, SamplingParams


class GenerateMsg(msgspec.Struct, frozen=True, tag="generate", omit_defaults=True):
    """Start a request. Exactly one of `prompt`, `prompt_token_ids` and `messages` is set.

    `sampling` crosses as SamplingParams itself (msgspec encodes the frozen dataclass and runs its
    validation again when the worker decodes it): there is no mirror to keep in step."""

    request_id: str
    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None  # chat: the worker applies the model's template
    chat_template_kwargs: dict[str, object] | None = None  # extra variables of that template
    add_generation_prompt: bool = True  # chat: end with the assistant turn's header
    continue_final_message: bool = False  # chat: continue the last message instead (vLLM's)
    add_special_tokens: bool = True
    # P/D fields (the roles read them; a unified worker ignores them).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    disagg_prefill_dp_rank: int | None = None
    register_room: bool = False  # prefill: tell the registry which DP rank took this room
    # decode: prefill the whole prompt here whatever --max-local-prefill-tokens says (our router sends
    # it while no prefill server serves: every decode prefills its own requests)
    disagg_prefill_here: bool = False
    # Pull flow (vLLM's NixlConnector fields): `do_remote_decode` on the prefill leg, the prefill's
    # ticket (`do_remote_prefill`, `remote_*`) on the decode leg.
    kv_transfer_params: dict | None = None
    # Migration: the tokens already streamed by a worker that died; the worker computes the prompt and
    # them locally (no KV transfer) and goes on from there, emitting only what follows.
    resume_token_ids: list[int] | None = None
    return_prompt: bool = False  # the first OutputMsg carries the prompt's token ids and text (echo, scoring)
    return_token_texts: bool = False  # OutputMsgs carry the text of every token in their logprobs
    # Scheduling, not sampling: lower is served first under --scheduling-policy priority (vLLM's).
    priority: int = 0
    traceparent: str = ""  # the front's span of this request (--otlp-traces-endpoint): a decode sends it to its prefill


class DecodeKey(msgspec.Struct, frozen=True):
    """One decode request as a prefill worker knows it: the decode worker's transfer identity and its
    request id (a TransferInfo's `peer_name` and `request_id`)."""

    peer_name: str
    request_id: str


class RoomFailedMsg(msgspec.Struct, frozen=True, tag="room_failed"):
    """Prefill front -> every worker: this room will never be served here; answer its decode so.
    `decode`: set when the failure is one decode's misrouting (RoomMisroutedMsg); the rank holding the
    room keeps it when another decode's destination is already there (that one is a stray duplicate)."""

    bootstrap_room: int
    reason: str
    decode: DecodeKey | None = None


class RoomPlacedMsg(msgspec.Struct, frozen=True, tag="room_placed"):
    """Prefill front -> every other worker: this room was dispatched to `dp_rank`. A decode that
    reaches another rank for it was misrouted (its disagg_prefill_dp_rank) and is answered at once."""

    bootstrap_room: int
    dp_rank: int


class AbortMsg(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str


class Utility(str, enum.Enum):
    """The calls a front makes on every DP worker (or on some); UTILITY_RESULTS types their answers."""

    IS_SLEEPING = "is_sleeping"
    SLEEP = "sleep"  # args: [level]
    WAKE_UP = "wake_up"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    STATS = "stats"  # a StatsMsg
    TOKENIZE = "tokenize"  # args: [TokenizeMsg]; a TokenizeResultMsg
    DETOKENIZE = "detokenize"  # args: [token ids] or [token ids, skip_special_tokens]; the text
    TOKENIZER_INFO = "tokenizer_info"  # the tokenizer's class and settings (vLLM's /tokenizer_info)
    INJECT_FAULT = "inject_fault"  # args: [kind, params]; --enable-fault-injection servers only
    HOLDING = "holding"  # what the role still holds (requests, rooms, leases, fences), or None: free to switch
    SWITCH_ROLE = "switch_role"  # args: [mode]; --enable-pd-role-switch: the worker's loop swaps its role

    def __str__(self) -> str:
        return self.value


class UtilityMsg(msgspec.Struct, frozen=True, tag="utility"):
    """Call an engine utility; a method outside the enum is refused when the worker decodes it."""

    call_id: int
    method: Utility
    args: list = []


class TokenizeMsg(msgspec.Struct, frozen=True, omit_defaults=True):
    """The argument of the `tokenize` utility (vLLM's /tokenize): exactly one of `prompt` and
    `messages` (plain-string contents; the worker applies the chat template)."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeResultMsg(msgspec.Struct, frozen=True, omit_defaults=True):
    """The answer of the `tokenize` utility; `error` (with `error_param`) when the input was refused."""

    tokens: list[int] = []
    token_strs: list[str] | None = None
    error: str | None = None
    error_param: str | None = None


class ShutdownMsg(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


ToWorker = GenerateMsg | AbortMsg | UtilityMsg | ShutdownMsg | RoomFailedMsg | RoomPlacedMsg


class KVStatsMsg(msgspec.Struct, frozen=True, omit_defaults=True):
    """Where a disaggregated request's time went (prefill side, or the decode's wait for its KV)."""

    bootstrap_wait_s: float = 0.0  # prefill: arrival -> the decode's destination blocks known
    prefill_compute_s: float = 0.0  # prefill: arrival -> prompt computed
    transfer_s: float = 0.0  # prefill: prompt computed and destination known -> every block landed; decode (pull): its read
    kv_bytes: int = 0
    kv_wait_s: float = 0.0  # decode: arrival -> KV admitted (its TTFT before the first decode step)
    decode_traceparent: str = ""  # prefill: the decode request's trace context, from its TransferInfo


class OutputMsg(msgspec.Struct, frozen=True, tag="output", omit_defaults=True):
    """Progress of one request: only what is new since the previous OutputMsg for it."""

    request_id: str
    new_token_ids: list[int] = []
    new_text: str = ""
    finish_reason: FinishReason | None = None  # encoded as its value: "stop", "length" or "abort"
    stop_reason: str | int | None = None
    # per new token: (id, logprob), sampled first, then the top-n, then SamplingParams.logprob_token_ids
    logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None  # on the first message only
    prompt_ranks: list[int | None] | None = None  # with them: each actual prompt token's rank (vLLM's `rank`)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # the request failed; `error_status` says how (400 bad input, 500, 503)
    error_status: int = 0
    error_param: str | None = None
    error_code: ErrorCode | None = None  # what a router may do about it (a local prefill refused)
    kv_transfer_params: dict | None = None  # pull flow, prefill: the ticket the decode reads with
    kv: KVStatsMsg | None = None  # on the prefill's final output and on the decode's first
    prompt_token_ids: list[int] | None = None  # on the first message, when GenerateMsg.return_prompt
    prompt_text: str | None = None  # ... the prompt detokenized (special tokens kept, as vLLM's echo)
    token_texts: dict[int, str] | None = None  # GenerateMsg.return_token_texts: id -> text, for this message's ids
    queued_s: float | None = None  # on the final message: arrival until the request first ran, in the engine
    num_preemptions: int = 0  # on the final message


class UtilityResultMsg(msgspec.Struct, frozen=True, tag="utility_result", omit_defaults=True):
    call_id: int
    result: object = None
    error: str | None = None


class ReadyMsg(msgspec.Struct, frozen=True, tag="ready"):
    """Sent once by a worker when its engine is loaded and warmed up."""

    dp_rank: int
    model_name: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    engine_summary: str = ""  # dtype and matmul kernels chosen, and why (the ready line, /server_info)
    compatibility: dict[str, str | int] = {}  # what a P/D peer must share (EngineCore.compatibility)
    eos_token_ids: list[int] = []  # the tokens that end a sequence (a beam search ends its beams at them)


class PdStatsMsg(msgspec.Struct, frozen=True):
    """A prefill or decode worker's P/D queues now and its requests that failed so far (SGLang's P/D
    metrics: its bootstrap, inflight, prealloc and transfer queues)."""

    prefill_bootstrap: int = 0  # prefill: requests whose decode's destination is not known yet
    prefill_inflight: int = 0  # prefill: requests computed whose KV is going out, or held for a reader (pull)
    decode_prealloc: int = 0  # decode: requests waiting for room in the KV cache
    decode_transfer: int = 0  # decode: requests whose KV is on its way
    num_bootstrap_failed: int = 0  # requests that failed before their KV could move (no destination, peer gone)
    num_transfer_failed: int = 0  # requests whose KV transfer failed (or landed corrupt)


class StatsMsg(msgspec.Struct, frozen=True, tag="stats"):
    """Periodic load report (drives least_load dispatch and the per-worker gauges)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_quarantined_blocks: int = 0  # blocks a remote writer may still write (not free, not in use)
    num_leases: int = 0  # prefill: pull-flow tickets whose blocks are still leased (a drain waits for them)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since the worker started
    prefix_cache_hits: int = 0  # of them, found cached (vLLM's vllm:prefix_cache_queries / _hits)
    # Waiting on something other than room: a decode's requests whose KV is on its way (vLLM's
    # num_requests_waiting_by_reason "deferred"; `num_waiting` is its "capacity").
    num_waiting_deferred: int = 0
    pd: PdStatsMsg | None = None  # a prefill's or decode's queues and failures


class RoomMisroutedMsg(msgspec.Struct, frozen=True, tag="room_misrouted"):
    """Prefill worker -> front: a decode asked this worker for a room another rank holds (it was told
    so by RoomPlacedMsg); the front fails the room on the rank that holds it, with `reason`, unless
    a destination from another decode is there already. `decode`: the asking decode."""

    bootstrap_room: int
    reason: str
    decode: DecodeKey | None = None


class StepMsg(msgspec.Struct, frozen=True, array_like=True):
    """One engine step that ran the model (disagg.engine.step_metrics.StepMetrics, field for field)."""

    wall_s: float
    num_prefill_tokens: int
    num_decode_seqs: int
    num_decode_kv_tokens: int
    num_running: int
    num_waiting: int


class StepsMsg(msgspec.Struct, frozen=True, tag="steps"):
    """Worker -> front, with its stats twice a second (and on its --step-metrics endpoint, ZMQ): the
    steps since the last report, oldest first; `seq` counts the worker's reports from 0."""

    dp_rank: int
    seq: int
    steps: list[StepMsg]


FromWorker = OutputMsg | UtilityResultMsg | ReadyMsg | StatsMsg | RoomMisroutedMsg | StepsMsg

# The struct a utility's answer is converted to on the front (the others are plain values).
UTILITY_RESULTS: dict[Utility, type[msgspec.Struct]] = {Utility.STATS: StatsMsg, Utility.TOKENIZE: TokenizeResultMsg}

_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(msg: ToWorker | FromWorker) -> bytes:
    return _encoder.encode(msg)


def decode_to_worker(data: bytes) -> ToWorker:
    return _to_worker.decode(data)


def decode_from_worker(data: bytes) -> FromWorker:
    return _from_worker.decode(data)
