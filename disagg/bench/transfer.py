"""`disagg bench transfer`: KV block transfer bandwidth and latency between two processes.

For SmolLM2-135M-sized KV (30 layers, 3 KV heads, head_dim 64, 16-token blocks) and prompts of 128,
1k, 4k and 16k tokens, this process WRITEs the prompt's blocks into a peer process through each
backend and reports GB/s next to a plain numpy copy of the same bytes measured in the same run,
plus the median latency of one 128-token transfer. `--tp-sizes 1:3,3:1` moves the same KV between
TP groups of those sizes (SmolLM2's 3 KV heads: one per rank at TP 3): each destination rank gets
its head slices (kvtransfer/heads.py), against whole blocks at 1:1.

    python -m disagg.bench.transfer [--backends nixl,tcp] [--dtypes bfloat16,float32] [--tp-sizes 1:1,1:3] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import msgspec
import numpy as np

from kvtransfer.base import KVLayout, KVTransferBackend, TransferState, wait, wait_all
from disagg.pd_config import default_checksum_piece_bytes
from kvtransfer.checksum import KVDigest, LandedDigest, kv_digest, piece_of, piece_tag, pieces
from kvtransfer.factory import available_backends, create_backend

SMOLLM2_KV = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size_tokens": 16}
DEFAULT_TOKENS = (128, 1024, 4096, 16384)
PEER_START_TIMEOUT_S = 60.0
TRANSFER_TIMEOUT_S = 60.0


@dataclass
class Row:
    """One prompt size: medians over alternating transfer/memcpy rounds, and the best transfer round."""

    backend: str
    dtype: str
    tokens: int
    size_bytes: int  # one copy of the prompt's KV
    transfer_gbps: float
    memcpy_gbps: float
    ratio: float
    best_transfer_gbps: float
    best_memcpy_gbps: float
    rounds: int
    tp: str = "1:1"  # source:destination TP sizes
    checksum_share: float = 0.0  # --kv-checksum: both sides' digests (2 x one, median) over the median transfer
    checked_cost: float = 0.0  # --kv-checksum as the product runs it: pieces digested while the next move, end to end
    pieces_cost: float = 0.0  # ... of which the pieces alone (no digest) against one write
    checked: bool = False  # --checked: the two costs above were measured


@dataclass
class Latency:
    backend: str
    dtype: str
    tokens: int
    median_us: float
    p90_us: float
    samples: int
    tp: str = "1:1"


def cache_layout(address: int, num_blocks: int, dtype: str, tp: int = 1) -> KVLayout:
    return KVLayout.for_cache(address, num_blocks, dtype=dtype, tp_size=tp, **SMOLLM2_KV)


def num_blocks_for(tokens: int) -> int:
    return -(-tokens // SMOLLM2_KV["block_size_tokens"])


def quiet_nixl() -> None:
    """NIXL logs INFO lines to stdout on import and agent creation; keep the table readable."""
    if "nixl" in available_backends():
        from kvtransfer.nixl import load_nixl

        load_nixl()
        logging.getLogger("nixl").setLevel(logging.WARNING)


def timed(fns: list[Callable[[], None]], min_time_s: float, min_rounds: int = 3,
          max_rounds: int = 200) -> list[list[float]]:
    """Seconds per call of each fn, run in alternating rounds until min_time_s has passed (at least
    min_rounds). Alternating keeps the ratios fair on a machine whose load changes under us."""
    samples: list[list[float]] = [[] for _ in fns]
    started = time.perf_counter()
    for _ in range(max_rounds):
        if len(samples[0]) >= min_rounds and time.perf_counter() - started >= min_time_s:
            break
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return samples


# -- the peer process -------------------------------------------------------------------------------


def serve_peer(backend_name: str, dtype: str, num_blocks: int, tp: int = 1) -> int:
    """Own a cache and a backend, print the metadata, answer stdin's commands until it says exit."""
    control = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # library noise must not corrupt the control channel
    quiet_nixl()
    probe = cache_layout(4096, num_blocks, dtype, tp)
    memory = np.ones(probe.size_bytes, dtype=np.uint8)  # touched: no page faults inside the timings
    received = 0
    with create_backend(backend_name) as backend:
        backend.register(cache_layout(memory.ctypes.data, num_blocks, dtype, tp))
        control.write(msgspec.json.encode({"metadata": backend.peer_metadata().hex()}) + b"\n")
        while True:  # notifications are drained only for a command: a round's pieces are its own
            line = sys.stdin.buffer.readline().split()
            if not line or line[0] == b"exit":
                break
            if line[0] == b"pieces":  # pieces COUNT BLOCKS CHECKED: a round of the checked transfer
                digest, others = receive_pieces(backend, int(line[1]), int(line[2]), line[3] == b"1", 10.0)
                received += others
                control.write(msgspec.json.encode({"digest": digest}) + b"\n")
                continue
            received += drain_until(backend, int(line[1]) - received, deadline_s=10.0)
            control.write(msgspec.json.encode({"notifications": received}) + b"\n")
    return 0


def receive_pieces(backend: KVTransferBackend, count: int, num_blocks: int, checked: bool,
                   deadline_s: float) -> tuple[int, int]:
    """Wait for `count` pieces of a write of blocks 0..num_blocks-1 (`piece_tag`s), digesting each
    as it lands when `checked`, as a decode with --kv-checksum does: (the digest, 0 unchecked; how many
    other notifications arrived meanwhile)."""
    landed = LandedDigest(backend.registered_layout, range(num_blocks)) if checked else None
    arrived, others, deadline = 0, 0, time.monotonic() + deadline_s
    while arrived < count and time.monotonic() < deadline:
        notes = backend.notifications()
        if not notes:
            time.sleep(0.0002)  # not a spin: the backend's own threads need the GIL (tcp receives in one)
        for note in notes:
            piece = piece_of(note.tag)
            if piece is None:
                others += 1
                continue
            arrived += 1
            if landed is not None:
                landed.landed(piece[1], piece[2])
    if arrived < count:
        raise TimeoutError(f"{arrived} of {count} pieces arrived within {deadline_s} s")
    return 0 if landed is None else landed.value(), others


def drain_until(backend: KVTransferBackend, count: int, deadline_s: float) -> int:
    """Drain notifications until `count` more arrived or the deadline passed; how many arrived."""
    received, deadline = 0, time.monotonic() + deadline_s
    while received < count and time.monotonic() < deadline:
        received += len(backend.notifications())
        time.sleep(0.001)
    return received


class PeerProcess:
    """The peer, spawned with this interpreter; replies read with a deadline."""

    def __init__(self, backend_name: str, dtype: str, num_blocks: int, tp: int = 1) -> None:
        command = [sys.executable, "-m", "disagg.bench.transfer", "--serve-peer", "--backends", backend_name,
                   "--dtypes", dtype, "--num-blocks", str(num_blocks), "--tp-sizes", f"{tp}:{tp}"]
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.metadata = bytes.fromhex(self._reply(PEER_START_TIMEOUT_S)["metadata"])

    def notifications(self, expected: int) -> int:
        """How many notifications the peer got, once `expected` arrived or 10 s passed."""
        self._proc.stdin.write(b"count %d\n" % expected)
        self._proc.stdin.flush()
        return self._reply(20.0)["notifications"]

    def expect_pieces(self, count: int, num_blocks: int, checked: bool) -> None:
        """Tell the peer a round of `count` pieces comes (before posting them: it digests as they land)."""
        self._proc.stdin.write(b"pieces %d %d %d\n" % (count, num_blocks, checked))
        self._proc.stdin.flush()

    def digest(self) -> int:
        """The peer's answer to expect_pieces: its digest of what landed (0 unchecked)."""
        return self._reply(20.0)["digest"]

    def _reply(self, timeout_s: float) -> dict:
        if not select.select([self._proc.stdout], [], [], timeout_s)[0]:
            raise TimeoutError(f"bench peer gave no answer within {timeout_s} s")
        line = self._proc.stdout.readline()
        if not line:
            raise ConnectionError(f"bench peer exited with status {self._proc.wait(5)}")
        return msgspec.json.decode(line)

    def close(self) -> None:
        try:
            self._proc.stdin.write(b"exit\n")
            self._proc.stdin.close()
            self._proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait(10)
        self._proc.stdout.close()


# -- measurements -----------------------------------------------------------------------------------


def transfer_once(backend: KVTransferBackend, peer: str, block_ids: list[int]) -> None:
    handle = backend.write(peer, block_ids, block_ids, b"bench")
    status = wait(backend, handle, TRANSFER_TIMEOUT_S)
    backend.release(handle)
    if status.state is not TransferState.SUCCESS:
        raise RuntimeError(f"bench transfer failed: {status.reason}")


def piece_round(backend: KVTransferBackend, peer: str, peer_process: PeerProcess, block_ids: list[int],
                checked: bool, whole: bool, piece_bytes: int) -> None:
    """One write of `block_ids` as a prefill with --kv-checksum posts it (in pieces, each digested
    right after it is posted) and the peer digests it (each piece as it lands), ended when the peer
    answers; `checked=False` the same pieces undigested, `whole` one write: the three cost apart."""
    layout = backend.registered_layout
    runs = [(0, len(block_ids))] if whole else list(pieces(0, len(block_ids), layout, piece_bytes))
    peer_process.expect_pieces(len(runs), len(block_ids), checked)
    digest = KVDigest(layout) if checked else None
    handles = []
    for start, end in runs:
        handles.append(backend.write(peer, block_ids[start:end], block_ids[start:end], piece_tag(0, start, end)))
        if digest is not None:
            digest.update(block_ids[start:end])
    statuses = wait_all(backend, handles, TRANSFER_TIMEOUT_S)
    for handle in handles:
        backend.release(handle)
    if any(s.state is not TransferState.SUCCESS for s in statuses):
        raise RuntimeError(f"bench transfer failed: {[s.reason for s in statuses]}")
    landed = peer_process.digest()
    if digest is not None and landed != digest.value():
        raise RuntimeError(f"the peer's digest {landed:016x} is not the sender's {digest.value():016x}")


def bench_pair(args: argparse.Namespace, backend_name: str, dtype: str, tokens: list[int],
               src: np.ndarray, dst: np.ndarray, tp: tuple[int, int] = (1, 1)) -> tuple[list[Row], Latency]:
    num_blocks = num_blocks_for(max(tokens))
    layout = cache_layout(src.ctypes.data, num_blocks, dtype, tp[0])
    peer_process = PeerProcess(backend_name, dtype, num_blocks, tp[1])
    rows = []
    try:
        with create_backend(backend_name) as backend:
            backend.register(layout)
            peer = backend.add_peer(peer_process.metadata)
            for count in tokens:
                block_ids = list(range(num_blocks_for(count)))
                size = len(block_ids) * layout.block_size_bytes * layout.tp_size
                transfer_once(backend, peer, block_ids)  # warm-up: connection, registration caches
                seconds, copy_s, digest_s = timed([lambda: transfer_once(backend, peer, block_ids),
                                                   lambda: np.copyto(dst[:size], src[:size]),
                                                   lambda: kv_digest(layout, block_ids)], args.min_time_s)
                share = 2 * statistics.median(digest_s) / statistics.median(seconds)
                rows.append(make_row(backend_name, dtype, count, size, seconds, copy_s, f"{tp[0]}:{tp[1]}", share))
                if args.checked:
                    piece_bytes = (default_checksum_piece_bytes(backend_name) if args.piece_kib is None
                                   else args.piece_kib << 10)
                    rows[-1].checked = True
                    rows[-1].pieces_cost, rows[-1].checked_cost = checked_costs(
                        backend, peer, peer_process, block_ids, args.min_time_s, piece_bytes)
                print(format_row(rows[-1]), file=sys.stderr, flush=True)
            small = list(range(num_blocks_for(128)))
            samples = timed([lambda: transfer_once(backend, peer, small)], 0.0, args.latency_iters, args.latency_iters)[0]
        expected = sum(r.rounds + 1 for r in rows) + args.latency_iters
        arrived = peer_process.notifications(expected)
        if arrived != expected:
            raise RuntimeError(f"peer saw {arrived} notifications for {expected} transfers")
    finally:
        peer_process.close()
    latency_us = sorted(s * 1e6 for s in samples)
    latency = Latency(backend_name, dtype, 128, statistics.median(latency_us),
                      latency_us[int(0.9 * (len(latency_us) - 1))], len(latency_us), f"{tp[0]}:{tp[1]}")
    return rows, latency


def checked_costs(backend: KVTransferBackend, peer: str, peer_process: PeerProcess, block_ids: list[int],
                  min_time_s: float, piece_bytes: int) -> tuple[float, float]:
    """(pieces, checked): the median end-to-end round of pieces undigested and of pieces digested on
    both sides, each over one whole write's, in alternating rounds."""
    rounds = [lambda checked=checked, whole=whole: piece_round(backend, peer, peer_process, block_ids, checked, whole,
                                                               piece_bytes)
              for checked, whole in ((False, True), (False, False), (True, False))]
    rounds[2]()  # warm-up
    whole_s, pieces_s, checked_s = (statistics.median(s) for s in timed(rounds, min_time_s))
    return pieces_s / whole_s - 1, checked_s / whole_s - 1


def make_row(backend: str, dtype: str, tokens: int, size: int, seconds: list[float], copy_s: list[float],
             tp: str = "1:1", checksum_share: float = 0.0) -> Row:
    median, median_copy = size / statistics.median(seconds) / 1e9, size / statistics.median(copy_s) / 1e9
    best, best_copy = size / min(seconds) / 1e9, size / min(copy_s) / 1e9
    return Row(backend, dtype, tokens, size, median, median_copy, median / median_copy, best, best_copy, len(seconds), tp,
               checksum_share)


def format_row(row: Row) -> str:
    return (f"| {row.backend} | {row.tp} | {row.dtype} | {row.tokens} | {row.size_bytes / 2**20:.1f} | "
            f"{row.transfer_gbps:.2f} | {row.memcpy_gbps:.2f} | {row.ratio:.0%} | {row.best_transfer_gbps:.2f} | "
            f"{row.checksum_share:.1%} |" + (f" {row.pieces_cost:+.1%} | {row.checked_cost:+.1%} |"
                                            if row.checked else ""))


def format_report(rows: list[Row], latencies: list[Latency]) -> str:
    checked = any(r.checked for r in rows)
    lines = [
        "| backend | TP src:dst | dtype | tokens | MiB | transfer GB/s | memcpy GB/s | of memcpy | best transfer GB/s | "
        "--kv-checksum (both digests) / transfer |" + (" in pieces, no digest | --kv-checksum, digests overlapped |"
                                                       if checked else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if checked else ""),
        *map(format_row, rows),
        "",
        "| backend | TP src:dst | dtype | latency of one 128-token transfer, median | p90 | samples |",
        "|---|---|---|---|---|---|",
        *(f"| {l.backend} | {l.tp} | {l.dtype} | {l.median_us:.0f} us | {l.p90_us:.0f} us | {l.samples} |"
          for l in latencies),
    ]
    return "\n".join(lines)


def tp_pairs(text: str) -> list[tuple[int, int]]:
    """`1:1,1:3` -> [(1, 1), (1, 3)]."""
    return [(int(a), int(b)) for a, b in (pair.split(":") for pair in text.split(","))]


def run(args: argparse.Namespace) -> int:
    quiet_nixl()
    tokens = [int(t) for t in args.tokens.split(",")]
    rows: list[Row] = []
    latencies: list[Latency] = []
    for dtype in args.dtypes.split(","):
        size = cache_layout(4096, num_blocks_for(max(tokens)), dtype).size_bytes
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        dst = np.ones(size, dtype=np.uint8)
        for backend_name in args.backends.split(","):
            for tp in tp_pairs(args.tp_sizes):
                pair_rows, latency = bench_pair(args, backend_name, dtype, tokens, src, dst, tp)
                rows += pair_rows
                latencies.append(latency)
    print(f"{os.cpu_count()} CPUs; SmolLM2-135M KV: {SMOLLM2_KV}\n")
    print(format_report(rows, latencies))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": [asdict(r) for r in rows], "latency": [asdict(l) for l in latencies]}, f, indent=2)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_backends = ",".join(b for b in available_backends() if b != "loopback")
    parser.add_argument("--backends", default=default_backends, help="comma-separated: nixl, tcp, loopback")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="KV cache dtypes")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)), help="prompt lengths")
    parser.add_argument("--min-time-s", type=float, default=0.5, help="time spent per measurement")
    parser.add_argument("--latency-iters", type=int, default=50, help="128-token transfers for the latency median")
    parser.add_argument("--tp-sizes", default="1:1", help="source:destination TP sizes, comma-separated (SmolLM2's 3 KV "
                        "heads split over 1 or 3 ranks, or replicated over 6)")
    parser.add_argument("--checked", action="store_true", help="also time --kv-checksum as the product runs it: the "
                        "write in pieces, each digested by the sender once posted and by the peer once landed, end "
                        "to end against one undigested write")
    parser.add_argument("--piece-kib", type=int, default=None, help="with --checked: the pieces' size, 0 whole writes "
                        "(default: --kv-checksum-piece-bytes' per backend)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--serve-peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `transfer` under `disagg bench`; the handler is in `parser.get_default('handler')`."""
    parser = subparsers.add_parser("transfer", help="KV transfer GB/s and latency between two processes")
    add_arguments(parser)
    parser.set_defaults(handler=dispatch)
    return parser


def dispatch(args: argparse.Namespace) -> int:
    if args.serve_peer:
        return serve_peer(args.backends, args.dtypes, args.num_blocks, tp_pairs(args.tp_sizes)[0][1])
    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="disagg bench transfer", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return dispatch(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
