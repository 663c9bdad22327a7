"""A DP worker as a tensor-parallel group (`--tensor-parallel-size N`): the worker process is rank 0
and starts N - 1 follower processes, each holding its shard of the model
(disagg/engine/models/tensor_parallel.py). Every rank runs the same requests: rank 0's role sees its
engine through `MirroredCore`, which hands each call that changes the engine (a request added,
aborted, released, its remote KV admitted, a step) to the followers first, in order, so their
schedulers form the same batches, give out the same block ids, and their collectives meet. Only rank
0 answers the front and moves KV: on a prefill or decode server the group's caches share one file
(SharedKV), which rank 0's transfer backend registers as one region. A follower that dies takes its
worker down: the controller restarts the whole group, as it does any dead worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import signal
import tempfile
import uuid
from typing import TYPE_CHECKING

import structlog

from disagg.cpus import split_cpus
from disagg.engine_config import EngineConfig
from disagg.wire.engine_msgs import ShutdownMsg

if TYPE_CHECKING:
    from disagg.worker.process import WorkerSpec

log = structlog.get_logger(__name__)
# The EngineCore methods that change its state: what the followers must do too, in rank 0's order.
MIRRORED = frozenset({"add_request", "abort", "fail", "release", "reserve_for_remote_kv", "admit_remote_kv",
                      "admit_remote_prefix", "reset_prefix_cache", "sleep", "wake_up", "step",
                      "set_scheduler_limits"})


def rank_engine(config: EngineConfig) -> EngineConfig:
    """Each rank's engine: the worker's torch threads shared among the group's processes."""
    size = config.tensor_parallel_size
    threads = config.num_threads or os.cpu_count() or 1
    return dataclasses.replace(config, num_threads=max(1, threads // size))


def rank_cpus(spec: WorkerSpec, rank: int) -> frozenset[int] | None:
    """The CPUs of one rank: the worker's (--cpus) in as many contiguous runs as the group has ranks,
    shared when there are fewer CPUs than ranks; None when the worker is not pinned."""
    return None if spec.cpus is None else split_cpus(spec.cpus, spec.engine.tensor_parallel_size)[rank]


class Followers:
    """Ranks 1..N-1 of one worker's group: started before rank 0 joins, fed every mirrored call."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.size = spec.engine.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix=f"disagg-tp{spec.dp_rank}-")
        self.rendezvous = f"file://{self._dir}/rendezvous"
        # P/D roles: the group's KV caches in one file every rank maps (in memory under /dev/shm)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else self._dir
        self.kv_file = os.path.join(shm, f"disagg-kv-{uuid.uuid4().hex}") if spec.role.moves_kv else None
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, self.size)]
        self._conns = [send for _, send in pipes]
        self._procs = [context.Process(target=follower_main, args=(spec, rank, self.rendezvous, self.kv_file, recv),
                                       daemon=True, name=f"disagg-dp{spec.dp_rank}-tp{rank}")
                       for rank, (recv, _) in enumerate(pipes, start=1)]

    def start(self) -> None:
        # multiprocessing refuses children to a daemonic process, and the worker is one (so that it
        # dies with its front). Its followers are daemonic too and die with it: lift the flag while
        # starting them.
        config = multiprocessing.current_process()._config
        daemon = config.get("daemon")
        config["daemon"] = False
        try:
            for process in self._procs:
                process.start()
        finally:
            config["daemon"] = daemon

    def forward(self, msg: object) -> None:
        for conn in self._conns:
            conn.send(msg)

    def unlink_kv_file(self) -> None:
        """Once every rank mapped it, the file's name can go: the mappings keep the memory."""
        if self.kv_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.kv_file)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(ShutdownMsg())
            except (BrokenPipeError, OSError):
                pass
        for process in self._procs:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
        self.unlink_kv_file()
        shutil.rmtree(self._dir, ignore_errors=True)


class MirroredCore:
    """Rank 0's engine as its role sees it: each call in MIRRORED goes to the followers before it
    runs here; everything else is the engine's own."""

    def __init__(self, core, followers: Followers):
        self._core = core
        self._followers = followers

    def __getattr__(self, name: str):
        attr = getattr(self._core, name)
        if name not in MIRRORED:
            return attr

        def mirrored(*args, **kwargs):
            self._followers.forward((name, args, kwargs))
            return attr(*args, **kwargs)
        return mirrored


def ignore_stop_signals() -> None:
    """An engine process ignores SIGINT and SIGTERM: sent to the whole process group (Ctrl-C, systemd's
    default, `kill -TERM -PGID`), they are its front's to handle, which drains and then stops its
    workers in order (each also exits when the front's connection closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def follower_main(spec: WorkerSpec, rank: int, rendezvous: str, kv_file: str | None, conn) -> None:
    """A follower process: join the group, build the rank's engine, make each call rank 0 made."""
    from disagg.logs import configure_logging

    if spec.cpus is not None:
        os.sched_setaffinity(0, rank_cpus(spec, rank))
    ignore_stop_signals()
    configure_logging(spec.log_format)
    structlog.contextvars.bind_contextvars(dp_rank=spec.dp_rank, tp_rank=rank, pid=os.getpid())
    from disagg.engine.core import EngineCore
    from disagg.engine.models.tensor_parallel import init_group

    engine = rank_engine(spec.engine)
    core = EngineCore(engine, tp=init_group(rank, engine.tensor_parallel_size, rendezvous, engine.model.device),
                      kv_file=kv_file)
    core.warm_up()  # rank 0 warms up too: the same forward passes, the same collectives
    log.info("tensor-parallel follower ready", num_blocks=core.num_blocks)
    follow(core, conn)


def follow(core, conn) -> None:
    """Make each call rank 0 made, in its order, until rank 0 is gone or says to stop. A call that
    raised on rank 0 raises here too and is dropped alike; a step that raises ends the follower
    (and with it the group)."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # rank 0 is gone
            return
        if isinstance(msg, ShutdownMsg):
            return
        name, args, kwargs = msg
        try:
            getattr(core, name)(*args, **kwargs)
        except Exception as exc:
            if name == "step":
                raise
            log.debug("a mirrored call raised (as on rank 0)", call=name, error=f"{type(exc).__name__}: {exc}")
        core.take_outputs()  # only rank 0 answers
