"""A KV transfer peer for the contract tests: owns a cache region and a backend, obeys JSON-line commands.

Run as a process (`python kv_peer.py --backend tcp ...`: commands on stdin, replies on the original
stdout, library noise sent to stderr) or in-process through `PeerState.handle` (the loopback twin).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import msgspec
import numpy as np

from kvtransfer.base import KVLayout, KVTransferBackend, wait
from kvtransfer.factory import create_backend


def block_checksum(memory: np.ndarray, block_id: int, block_bytes: int) -> str:
    return hashlib.sha256(memory[block_id * block_bytes: (block_id + 1) * block_bytes].tobytes()).hexdigest()


def fill_blocks(memory: np.ndarray, block_ids: list[int], block_bytes: int, seed: int) -> list[str]:
    """Random bytes into each block; returns their sha256 in order."""
    rng = np.random.default_rng(seed)
    for block_id in block_ids:
        memory[block_id * block_bytes: (block_id + 1) * block_bytes] = rng.integers(0, 256, block_bytes, dtype=np.uint8)
    return [block_checksum(memory, block_id, block_bytes) for block_id in block_ids]


class PeerState:
    """The peer's memory and backend; `handle` runs one command dict and returns the reply dict."""

    def __init__(self, backend: KVTransferBackend, num_blocks: int, block_bytes: int, block_tokens: int, dtype: str):
        self.memory = np.zeros(num_blocks * block_bytes, dtype=np.uint8)
        self.block_bytes = block_bytes
        self.backend = backend
        backend.register(KVLayout(self.memory.ctypes.data, num_blocks, block_bytes, block_tokens, dtype))

    def hello(self) -> dict:
        return {"name": self.backend.agent_name, "metadata": self.backend.peer_metadata().hex(), "pid": os.getpid()}

    def handle(self, request: dict) -> dict:
        return getattr(self, f"op_{request.pop('op')}")(**request)

    def op_fill(self, block_ids: list[int], seed: int) -> dict:
        return {"checksums": fill_blocks(self.memory, block_ids, self.block_bytes, seed)}

    def op_checksums(self, block_ids: list[int] | None = None) -> dict:
        ids = range(len(self.memory) // self.block_bytes) if block_ids is None else block_ids
        return {"checksums": [block_checksum(self.memory, block_id, self.block_bytes) for block_id in ids]}

    def op_notifications(self, expect: int, timeout_s: float) -> dict:
        """Everything that arrives until `expect` notifications are in or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        got = list(self.backend.notifications())
        while len(got) < expect and time.monotonic() < deadline:
            time.sleep(0.002)
            got += self.backend.notifications()
        return {"notifications": [[n.peer, n.tag.hex()] for n in got]}

    def op_add_peer(self, metadata: str) -> dict:
        return {"name": self.backend.add_peer(bytes.fromhex(metadata))}

    def op_write(self, peer: str, local: list[int], remote: list[int], tag: str, timeout_s: float) -> dict:
        handle = self.backend.write(peer, local, remote, bytes.fromhex(tag))
        status = wait(self.backend, handle, timeout_s)
        self.backend.release(handle)
        return {"state": status.state.name, "reason": status.reason}

    def op_close(self) -> dict:
        self.backend.close()
        return {"registered": self.backend.registered_layout is not None}


def main(argv: list[str] | None = None) -> int:
    control = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # NIXL logs to stdout; keep the control channel clean
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--cluster-secret", default=None)
    args = parser.parse_args(argv)
    backend = create_backend(args.backend, cluster_secret=args.cluster_secret)
    state = PeerState(backend, args.num_blocks, args.block_bytes, args.block_tokens, args.dtype)
    control.write(msgspec.json.encode(state.hello()) + b"\n")
    for line in sys.stdin.buffer:
        request = msgspec.json.decode(line)
        if request["op"] == "exit":
            break
        try:
            reply = state.handle(request)
        except Exception as exc:  # report to the test instead of dying silently
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        control.write(msgspec.json.encode(reply) + b"\n")
    state.backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
