"""The KV transfer seam: layout, transfer states, errors, the backend Protocol and deadline waits.

A backend moves whole KV blocks between two registered cache regions, NIXL-style:
register -> peer_metadata/add_peer -> write/read (with a notification tag) -> poll -> release.
It sees a `KVLayout`, block ids, peer names and opaque tags; never requests or the engine.
"""

from __future__ import annotations

import enum
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from disagg.wire.states import TransferState
from kvtransfer.heads import rank_heads, split_problem

if TYPE_CHECKING:
    from kvtransfer.descriptors import Descriptor

# Bytes per element of the cache dtypes the engine uses; KVLayout.for_cache derives block sizes from it.
DTYPE_SIZE_BYTES = {
    "float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1,
}
_DEVICE = re.compile(r"^(cpu|cuda:\d+)$")


class KVTransferError(Exception):
    """Base of every error kvtransfer raises."""


class TransferFailed(KVTransferError):
    """A transfer ended FAILED; `reason` says why. `peer_lost`: because the connection to the peer
    broke (a retry elsewhere may succeed), not because of the request."""

    def __init__(self, reason: str, *, peer_lost: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.peer_lost = peer_lost


class PeerUnavailable(KVTransferError):
    """The peer is unknown, unreachable or gone."""


class IncompatiblePeer(KVTransferError):
    """The peer's metadata cannot be used by this backend (other backend, bad encoding)."""


class AuthenticationFailed(KVTransferError):
    """A peer refused our cluster secret, or required one we do not hold, or did not prove it holds ours.

    The message names the peer and says which; the connection is closed and nothing was transferred."""


class LayoutMismatch(IncompatiblePeer):
    """The peer's page size, dtype or block size differs from ours; refused at handshake."""


class BackendUnavailable(KVTransferError):
    """The requested backend cannot run here; the message names the backends that can."""


class NotRegistered(KVTransferError):
    """The call needs a registered layout and there is none."""


class BackendClosed(KVTransferError):
    """The backend was closed; it can no longer be used."""


class UnknownTransfer(KVTransferError):
    """The handle was released (or never belonged to this backend)."""


class InvalidBlockIds(KVTransferError, ValueError):
    """Block ids out of range, repeated, empty, or local/remote lists of different lengths."""


class InvalidLayout(KVTransferError, ValueError):
    """A KVLayout field is out of range."""


@dataclass(frozen=True)
class KVLayout:
    """Where a worker's KV cache lives. One block of one rank is one contiguous byte range.

    The engine lays a cache out as [num_blocks, num_layers, 2, block_size_tokens, rank's kv heads,
    head_dim]. A tensor-parallel group registers its `tp_size` ranks' caches back to back in one
    region (kvtransfer/heads.py), so rank r's block `i` starts at `base_address + (r * num_blocks + i)
    * block_size_bytes`. `num_kv_heads` is the model's (0: not named, for a layout with tp_size 1).
    The memory belongs to the caller; backends keep only these numbers.
    """

    base_address: int
    num_blocks: int
    block_size_bytes: int  # one block of one rank across all layers, K and V
    block_size_tokens: int  # page size
    dtype: str
    device: str = "cpu"  # "cpu" or "cuda:N"
    num_layers: int = 1  # informational: block_size_bytes already covers every layer
    num_kv_heads: int = 0  # the model's KV heads, split over the ranks
    head_dim: int = 0
    tp_size: int = 1  # the ranks whose caches the region holds

    def __post_init__(self) -> None:
        for field_name in ("base_address", "num_blocks", "block_size_bytes", "block_size_tokens", "num_layers", "tp_size"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidLayout(f"KVLayout.{field_name} must be a positive int, got {value!r}")
        for field_name in ("num_kv_heads", "head_dim"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 0:
                raise InvalidLayout(f"KVLayout.{field_name} must be a non-negative int, got {value!r}")
        if not self.dtype:
            raise InvalidLayout("KVLayout.dtype must be a non-empty dtype name such as 'bfloat16'")
        if not _DEVICE.match(self.device):
            raise InvalidLayout(f"KVLayout.device must be 'cpu' or 'cuda:N', got {self.device!r}")
        if self.tp_size > 1:
            problem = (split_problem(self.num_kv_heads, self.tp_size) if self.num_kv_heads and self.head_dim
                       else "a layout with tp_size > 1 names num_kv_heads and head_dim")
            if problem:
                raise InvalidLayout(f"KVLayout: {problem}")

    @classmethod
    def for_cache(
        cls, base_address: int, num_blocks: int, *, num_layers: int, block_size_tokens: int,
        num_kv_heads: int, head_dim: int, dtype: str, device: str = "cpu", tp_size: int = 1,
    ) -> KVLayout:
        """The layout of `tp_size` [num_blocks, num_layers, 2, block_size_tokens, kv heads, head_dim]
        caches back to back, each rank with its share of the model's `num_kv_heads`."""
        if dtype not in DTYPE_SIZE_BYTES:
            raise InvalidLayout(f"unknown KV dtype {dtype!r}; known: {', '.join(DTYPE_SIZE_BYTES)}")
        problem = split_problem(num_kv_heads, tp_size) if num_kv_heads > 0 and tp_size > 0 else None
        if problem:
            raise InvalidLayout(f"KVLayout: {problem}")
        start, end = rank_heads(num_kv_heads, tp_size, 0) if tp_size > 0 else (0, num_kv_heads)
        block_size_bytes = num_layers * 2 * block_size_tokens * (end - start) * head_dim * DTYPE_SIZE_BYTES[dtype]
        return cls(base_address, num_blocks, block_size_bytes, block_size_tokens, dtype, device, num_layers,
                   num_kv_heads, head_dim, tp_size)

    @property
    def size_bytes(self) -> int:
        return self.tp_size * self.num_blocks * self.block_size_bytes

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_id(self) -> int:
        return int(self.device.split(":")[1]) if self.is_cuda else 0

    def block_address(self, block_id: int, rank: int = 0) -> int:
        return self.base_address + (rank * self.num_blocks + block_id) * self.block_size_bytes


@dataclass(frozen=True)
class TransferStatus:
    """What poll() returns: the state, and for FAILED the reason."""

    state: TransferState
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.state is TransferState.SUCCESS

    def raise_if_failed(self) -> None:
        """Raise TransferFailed(reason) when FAILED: for callers that treat a failure as an exception."""
        if self.state is TransferState.FAILED:
            raise TransferFailed(self.reason)


class TransferOp(enum.Enum):
    WRITE = "WRITE"  # local blocks -> peer blocks; the peer gets the notification
    READ = "READ"  # peer blocks -> local blocks; the peer gets the notification


@dataclass(frozen=True)
class TransferHandle:
    """Names one posted transfer. A plain value: the backend owns all state behind it."""

    transfer_id: int
    peer: str
    op: TransferOp
    num_blocks: int
    num_bytes: int


class Notification(NamedTuple):
    """A tag that arrived from `peer`: after its write into us landed, its read from us finished,
    or a standalone notify()."""

    peer: str
    tag: bytes


@runtime_checkable
class KVTransferBackend(Protocol):
    """One request-agnostic KV block mover. Not thread-safe for concurrent calls unless a backend says so."""

    @property
    def backend_name(self) -> str:
        """The backend kind: 'nixl', 'tcp' or 'loopback'."""

    @property
    def agent_name(self) -> str:
        """This endpoint's unique name: what peers see in notifications and add_peer() returns."""

    @property
    def registered_layout(self) -> KVLayout | None:
        """The registered layout, or None before register() and after deregister()/close()."""

    def register(self, layout: KVLayout) -> None:
        """Register the whole cache region once and prepare per-block descriptors.
        Raises KVTransferError if a layout is already registered."""

    def deregister(self) -> None:
        """Abort every live transfer, forget every peer and release the registration.
        After register() again, peers need the new peer_metadata()."""

    def peer_metadata(self) -> bytes:
        """Opaque bytes a peer passes to add_peer(): our name, layout and transport address."""

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and return its name. Raises LayoutMismatch when the page size,
        dtype or block size differ, IncompatiblePeer for another backend's metadata."""

    def remove_peer(self, peer: str) -> None:
        """Fail the peer's live transfers and drop it. Unknown peers are ignored."""

    def cut_inbound(self, peer: str) -> bool:
        """Stop writes `peer` posts into our region: when this returns True, none can land any
        more. False when the transport cannot refuse a one-sided write (NIXL/UCX: the writer's
        own fencing is all there is)."""

    def describe(self, block_ids: Sequence[int]) -> list[Descriptor]:
        """Descriptors (address, size_bytes, device_id) of our blocks; adjacent ids coalesce."""

    def write(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
              notif_tag: bytes) -> TransferHandle:
        """Post local blocks -> peer blocks; the peer receives `notif_tag` once the bytes landed.
        Raises for caller errors (unknown peer, bad ids); transport failures show up as FAILED."""

    def read(self, peer: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int],
             notif_tag: bytes) -> TransferHandle:
        """Post peer blocks -> local blocks; the peer receives `notif_tag` once they were read."""

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """Current status, progressing the transfer if the backend needs it. Raises UnknownTransfer
        after release()."""

    def abort(self, handle: TransferHandle, reason: str) -> None:
        """Mark a live transfer FAILED with `reason` and cancel it where possible. No-op when terminal."""

    def release(self, handle: TransferHandle) -> None:
        """Forget the transfer (aborting it if live); late events for it are dropped."""

    def notifications(self) -> list[Notification]:
        """Drain the notifications that arrived since the last call, each exactly once."""

    def notify(self, peer: str, tag: bytes) -> None:
        """Send a standalone notification to a peer."""

    def close(self) -> None:
        """deregister(), then free the agent/sockets/threads. Idempotent."""

    def __enter__(self) -> KVTransferBackend:
        """Return self."""

    def __exit__(self, *exc_info: object) -> None:
        """close()."""


def backoff_delays(initial_s: float = 50e-6, max_s: float = 1e-3, growth: float = 1.25) -> Iterator[float]:
    """Sleep lengths between polls: two immediate re-polls, then growing by `growth` up to `max_s`.
    Slow growth keeps the overshoot past a completion under ~25% (a caller's latency is ours)."""
    yield 0.0
    yield 0.0
    delay = initial_s
    while True:
        yield delay
        delay = min(delay * growth, max_s)


def wait(
    backend: KVTransferBackend, handle: TransferHandle, timeout_s: float, *,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> TransferStatus:
    """Poll with backoff until the transfer is terminal. Past the deadline the transfer is aborted
    and ends FAILED with reason 'deadline exceeded after X s'."""
    return wait_all(backend, [handle], timeout_s, clock=clock, sleep=sleep)[0]


def wait_all(
    backend: KVTransferBackend, handles: Sequence[TransferHandle], timeout_s: float, *,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> list[TransferStatus]:
    """wait() for several transfers under one deadline; statuses come back in `handles` order."""
    deadline = clock() + timeout_s
    done: dict[int, TransferStatus] = {}
    for delay in backoff_delays():
        for handle in handles:
            if handle.transfer_id not in done:
                status = backend.poll(handle)
                if status.state.is_terminal:
                    done[handle.transfer_id] = status
        now = clock()
        if len(done) == len(handles) or now >= deadline:
            break
        sleep(min(delay, deadline - now))
    for handle in handles:
        if handle.transfer_id not in done:
            backend.abort(handle, f"deadline exceeded after {timeout_s:g} s")
            done[handle.transfer_id] = backend.poll(handle)
    return [done[handle.transfer_id] for handle in handles]
