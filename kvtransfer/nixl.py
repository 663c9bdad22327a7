"""NIXL backend: one NIXL agent with the UCX backend over the registered cache (DRAM or VRAM).

The whole region is registered once; per-block descriptor lists are prepped once locally and once per
peer, and each transfer is posted by block index (make_prepped_xfer). NIXL merges descriptors that are
contiguous on both sides, so a run of adjacent blocks moves as one range (measured: as fast as one
coalesced descriptor). Between caches of different TP sizes, host memory moves whole blocks through a
staging buffer registered for the transfer (kvtransfer/staging.py). Completion: check_xfer_state
here, the notification tag at the peer. This module is the only importer of NIXL.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from kvtransfer.base import (
    BackendUnavailable, IncompatiblePeer, KVLayout, KVTransferError, Notification, PeerUnavailable,
    TransferHandle, TransferOp, TransferState,
)
from kvtransfer.core import BackendCore
from kvtransfer.descriptors import BlockRun, Slices, host_view
from kvtransfer.handshake import PeerInfo
from kvtransfer.heads import head_slice_copies
from kvtransfer.staging import stage

NIXL_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")
# NIXL's progress thread waits this long on UCX events before re-polling (it wakes on events anyway).
DEFAULT_PROGRESS_DELAY_US = 10_000
_UCX = ["UCX"]
_CONFIG_PATCH_LOCK = threading.Lock()


def nixl_installed() -> bool:
    """True when a NIXL wheel is installed (checked without importing it)."""
    return any(importlib.util.find_spec(name.split(".")[0]) is not None for name in NIXL_MODULES)


def load_nixl() -> ModuleType:
    """Import NIXL's Python API (nixl_cu12, nixl_cu13 or nixl, first found)."""
    tried = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            tried.append(f"{name}: {exc}")
    raise BackendUnavailable(
        "transfer backend 'nixl' is unavailable: NIXL is not importable ("
        + "; ".join(tried) + "). Install it with `pip install 'disagg[nixl]'`; available backends: tcp, loopback"
    )


@contextlib.contextmanager
def _progress_delay(api: ModuleType, delay_us: int) -> Iterator[None]:
    """nixl_agent.__init__ hard-codes pthrDelay=0, which makes NIXL's progress thread busy-poll a core.
    On a 2-core host that starved the caller: an 8-block write took ~12 ms instead of ~80 us. While the
    agent is built, hand NIXL a config class that stores `delay_us` instead."""
    bindings = getattr(api, "nixlBind", None)
    original = getattr(bindings, "nixlAgentConfig", None)
    if original is None or delay_us <= 0:
        yield
        return

    class DelayedConfig(original):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            super().__setattr__(key, delay_us if key == "pthrDelay" else value)

    with _CONFIG_PATCH_LOCK:
        bindings.nixlAgentConfig = DelayedConfig
        try:
            yield
        finally:
            bindings.nixlAgentConfig = original


def _mem_type(layout: KVLayout) -> str:
    return "VRAM" if layout.is_cuda else "DRAM"


def _block_array(layout: KVLayout) -> np.ndarray:
    """Nx3 (address, size_bytes, device_id), one row per block of every TP rank: the list NIXL preps once."""
    offsets = np.arange(layout.tp_size * layout.num_blocks, dtype=np.uint64) * layout.block_size_bytes
    return _ranges(layout.base_address, offsets, layout.block_size_bytes, layout.device_id)


def _slice_array(layout: KVLayout, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Nx3 (address, size_bytes, device_id) of byte copies at `offsets` from the region's start."""
    return _ranges(layout.base_address, offsets, sizes, layout.device_id)


def _run_indices(runs: list[BlockRun]) -> tuple[np.ndarray, np.ndarray]:
    local = np.concatenate([np.arange(r.local_start, r.local_start + r.num_blocks, dtype=np.int32) for r in runs])
    remote = np.concatenate([np.arange(r.remote_start, r.remote_start + r.num_blocks, dtype=np.int32) for r in runs])
    return local, remote


def _explain(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class _StagedXfer:
    """A transfer between caches of different TP sizes through a staging buffer of whole blocks,
    registered for this transfer and deregistered once NIXL has released it."""

    def __init__(self, agent: Any, staging: np.ndarray, registration: Any, finish: Any = None) -> None:
        self.agent, self.staging, self.registration, self.finish = agent, staging, registration, finish
        self.xfer: Any = None

    @classmethod
    def post(cls, agent: Any, handle: TransferHandle, local: KVLayout, remote: KVLayout,
             block_ids: tuple[list[int], list[int]], notif_tag: bytes) -> _StagedXfer:
        staged_copy = stage(handle.op is TransferOp.WRITE, np.frombuffer(host_view(local), dtype=np.uint8), local,
                            remote, block_ids)
        plan, buffer = staged_copy.plan, staged_copy.buffer
        registration = agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM", backends=_UCX)
        staged = cls(agent, buffer, registration, staged_copy.finish)
        try:
            staged.xfer = agent.initialize_xfer(
                handle.op.value,
                agent.get_xfer_descs(_ranges(buffer.ctypes.data, np.arange(len(plan.remote_offsets)) * plan.block_bytes,
                                             plan.block_bytes, 0), "DRAM"),
                agent.get_xfer_descs(_ranges(remote.base_address, plan.remote_offsets, plan.block_bytes,
                                             remote.device_id), _mem_type(remote)),
                handle.peer, notif_tag, backends=_UCX)
        except BaseException:
            staged.release()
            raise
        return staged

    def release(self) -> None:
        """Release the NIXL handle (raising, as NIXL does, while it cannot be cancelled yet), then the buffer."""
        if self.xfer is not None:
            self.xfer.release()
            self.xfer = None
        if self.registration is not None:
            self.agent.deregister_memory(self.registration, backends=_UCX)
            self.registration = None


def _ranges(base: int, offsets: np.ndarray, sizes: np.ndarray | int, device_id: int) -> np.ndarray:
    """Nx3 (address, size_bytes, device_id) of byte ranges at `offsets` from `base`."""
    table = np.empty((offsets.size, 3), dtype=np.uint64)
    table[:, 0] = base + offsets.astype(np.uint64)
    table[:, 1] = sizes
    table[:, 2] = device_id
    return table


class NixlBackend(BackendCore):
    """One lock guards every call into the NIXL agent."""

    backend_name = "nixl"

    def __init__(self, agent_name: str | None = None, *, num_threads: int = 0,
                 progress_delay_us: int = DEFAULT_PROGRESS_DELAY_US) -> None:
        super().__init__(agent_name)
        api = load_nixl()
        config = api.nixl_agent_config(enable_prog_thread=True, backends=list(_UCX), num_threads=num_threads)
        try:
            with _progress_delay(api, progress_delay_us):
                self._agent: Any = api.nixl_agent(self._agent_name, config)
        except Exception as exc:  # NIXL raises its own binding errors (e.g. nixlBackendError)
            raise BackendUnavailable(
                f"NIXL could not start an agent with UCX: {_explain(exc)}; available backends: tcp, loopback"
            ) from None
        if "UCX" not in self._agent.backends:
            raise BackendUnavailable("NIXL loaded without its UCX plugin; available backends: tcp, loopback")
        self._lock = threading.RLock()
        self._xfers: dict[int, Any] = {}
        self._zombies: list[Any] = []  # aborted xfer handles NIXL could not release yet
        self._remote_dlists: dict[str, Any] = {}
        self._local_dlist: Any = None
        self._reg_descs: Any = None

    def _on_register(self, layout: KVLayout) -> None:
        region = [(layout.base_address, layout.size_bytes, layout.device_id, "")]
        with self._lock:
            try:
                self._reg_descs = self._agent.register_memory(region, _mem_type(layout), backends=_UCX)
                self._local_dlist = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", _block_array(layout), _mem_type(layout), backends=_UCX
                )
            except Exception as exc:
                self._release_registration()
                raise KVTransferError(
                    f"NIXL could not register {layout.size_bytes} bytes on {layout.device}: {_explain(exc)}"
                ) from None

    def _on_deregister(self) -> None:
        with self._lock:
            for xfer in self._xfers.values():
                self._release_xfer(xfer)
            self._xfers.clear()
            for name in list(self._remote_dlists):
                self._drop_remote(name)
            self._reap_zombies()
            self._release_registration()

    def _release_registration(self) -> None:
        if self._local_dlist is not None:
            self._local_dlist.release()
            self._local_dlist = None
        if self._reg_descs is not None:
            self._agent.deregister_memory(self._reg_descs, backends=_UCX)
            self._reg_descs = None

    def _transport_info(self, info: PeerInfo) -> PeerInfo:
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return PeerInfo(info.backend, info.name, info.layout, agent_metadata=metadata)

    def _on_add_peer(self, info: PeerInfo) -> None:
        with self._lock:
            try:
                loaded = self._agent.add_remote_agent(info.agent_metadata)
            except Exception as exc:
                raise PeerUnavailable(f"NIXL could not load peer {info.name!r}: {_explain(exc)}") from None
            name = loaded.decode() if isinstance(loaded, bytes) else loaded
            if name != info.name:
                self._agent.remove_remote_agent(name)
                raise IncompatiblePeer(f"peer metadata names {info.name!r} but its NIXL agent is {name!r}")
            try:
                self._remote_dlists[name] = self._agent.prep_xfer_dlist(
                    name, _block_array(info.layout), _mem_type(info.layout), backends=_UCX
                )
                self._agent.make_connection(name, backends=_UCX)
            except Exception as exc:
                self._drop_remote(name)
                raise PeerUnavailable(f"NIXL could not connect to peer {name!r}: {_explain(exc)}") from None

    def _on_remove_peer(self, peer: str) -> None:
        with self._lock:
            for transfer_id in [tid for tid in self._xfers if self._handles[tid].peer == peer]:
                self._release_xfer(self._xfers.pop(transfer_id))
            self._drop_remote(peer)

    def _drop_remote(self, name: str) -> None:
        dlist = self._remote_dlists.pop(name, None)
        with contextlib.suppress(Exception):  # a peer that already died cannot refuse to be dropped
            if dlist is not None:
                dlist.release()
            self._agent.remove_remote_agent(name)

    def _post(self, handle: TransferHandle, runs: list[BlockRun], notif_tag: bytes) -> None:
        local_ids, remote_ids = _run_indices(runs)
        with self._lock:
            try:
                xfer = self._agent.make_prepped_xfer(
                    handle.op.value, self._local_dlist, local_ids, self._remote_dlists[handle.peer], remote_ids,
                    notif_tag, backends=_UCX,
                )
            except Exception as exc:
                self._transfers.fail(handle.transfer_id, self._reason(handle, exc))
                return
            self._xfers[handle.transfer_id] = xfer
            self._settle(handle, self._call(self._agent.transfer, xfer))

    def _post_slices(self, handle: TransferHandle, block_ids: tuple[list[int], list[int]], notif_tag: bytes) -> None:
        """Head slices are thousands of small ranges a block, and NIXL pays per range: host memory
        moves whole blocks through a staging buffer instead (kvtransfer/staging.py); device memory
        takes one descriptor per range, in a transfer built for it."""
        local, remote = self._layout, self._peers[handle.peer].layout
        assert local is not None
        with self._lock:
            try:
                if self._per_slice(local, remote):
                    slices = self._head_slices(handle, block_ids)
                    xfer: Any = self._agent.initialize_xfer(
                        handle.op.value,
                        self._agent.get_xfer_descs(_slice_array(local, slices.local, slices.size), _mem_type(local)),
                        self._agent.get_xfer_descs(_slice_array(remote, slices.remote, slices.size), _mem_type(remote)),
                        handle.peer, notif_tag, backends=_UCX)
                else:
                    xfer = _StagedXfer.post(self._agent, handle, local, remote, block_ids, notif_tag)
            except Exception as exc:
                self._transfers.fail(handle.transfer_id, self._reason(handle, exc))
                return
            self._xfers[handle.transfer_id] = xfer
            self._settle(handle, self._call(self._agent.transfer, xfer))

    @staticmethod
    def _per_slice(local: KVLayout, remote: KVLayout) -> bool:
        """Device memory on either side: one descriptor per head slice (no host staging buffer)."""
        return local.is_cuda or remote.is_cuda

    def _head_slices(self, handle: TransferHandle, block_ids: tuple[list[int], list[int]]) -> Slices:
        """The byte copies of a transfer between caches of different TP sizes (kvtransfer/heads.py)."""
        (local, remote), ours, theirs = block_ids, self._require_layout(), self._require_peer(handle.peer).layout
        if handle.op is TransferOp.WRITE:
            copies = head_slice_copies(ours, theirs, local, remote)
            return Slices(copies.src, copies.dst, copies.size)
        copies = head_slice_copies(theirs, ours, remote, local)
        return Slices(copies.dst, copies.src, copies.size)

    def _progress(self, handle: TransferHandle) -> None:
        with self._lock:
            xfer = self._xfers.get(handle.transfer_id)
            if xfer is not None:
                self._settle(handle, self._call(self._agent.check_xfer_state, xfer))

    @staticmethod
    def _call(method: Any, xfer: Any) -> str | Exception:
        try:
            return method(getattr(xfer, "xfer", xfer))  # a staged transfer's own NIXL handle
        except Exception as exc:  # NIXL raises e.g. nixlRemoteDisconnectError for a dead peer
            return exc

    def _settle(self, handle: TransferHandle, state: str | Exception) -> None:
        """Apply a NIXL state ('DONE', 'PROC', 'ERR' or the exception a call raised)."""
        if state == "PROC":
            return
        if state == "DONE":
            finish = getattr(self._xfers[handle.transfer_id], "finish", None)
            if finish is not None:
                finish()  # a staged read: the blocks are in the staging buffer, now in the cache
            self._transfers.advance(handle.transfer_id, TransferState.SUCCESS)
        else:
            self._transfers.fail(handle.transfer_id, self._reason(handle, state))
        self._release_xfer(self._xfers.pop(handle.transfer_id))

    @staticmethod
    def _reason(handle: TransferHandle, state: str | Exception) -> str:
        what = _explain(state) if isinstance(state, Exception) else f"NIXL state {state}"
        return f"NIXL {handle.op.value} with peer {handle.peer!r} failed: {what}"

    def _cancel(self, handle: TransferHandle) -> None:
        with self._lock:
            xfer = self._xfers.pop(handle.transfer_id, None)
            if xfer is not None:
                self._release_xfer(xfer)

    def _release_xfer(self, xfer: Any) -> None:
        """Release (cancelling if active); NIXL refuses while the transfer cannot be cancelled yet."""
        try:
            xfer.release()
        except Exception:
            self._zombies.append(xfer)

    def _reap_zombies(self) -> None:
        zombies, self._zombies = self._zombies, []
        for xfer in zombies:
            self._release_xfer(xfer)

    def _drain_notifications(self) -> list[Notification]:
        with self._lock:
            arrived = self._agent.get_new_notifs()
            self._reap_zombies()
        return [Notification(peer, bytes(tag)) for peer, tags in arrived.items() for tag in tags]

    def _send_notification(self, peer: str, tag: bytes) -> None:
        with self._lock:
            try:
                self._agent.send_notif(peer, tag)
            except Exception as exc:
                raise PeerUnavailable(f"NIXL could not notify peer {peer!r}: {_explain(exc)}") from None

    def _on_close(self) -> None:
        with self._lock:
            self._reap_zombies()
            self._agent = None
