"""A DP worker as a tensor-parallel group (`--tensor-parallel-size N`, unified servers): the worker
process is rank 0 and starts N - 1 follower processes, each holding its shard of the model
(disagg/engine/models/tensor_parallel.py). Every rank runs the same requests: rank 0 hands each
message it applies, and each engine step, to the followers in order, so their schedulers form the
same batches and their collectives meet; only rank 0 answers the front. A follower that dies takes
its worker down: the controller restarts the whole group, as it does any dead worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import shutil
import signal
import tempfile
from typing import TYPE_CHECKING

import structlog

from disagg.engine_config import EngineConfig
from disagg.wire.engine_msgs import ShutdownMsg

if TYPE_CHECKING:
    from disagg.dp.worker import WorkerSpec

log = structlog.get_logger(__name__)
STEP = "step"


def rank_engine(config: EngineConfig) -> EngineConfig:
    """Each rank's engine: the worker's torch threads shared among the group's processes."""
    size = config.tensor_parallel_size
    threads = config.num_threads or os.cpu_count() or 1
    return dataclasses.replace(config, num_threads=max(1, threads // size))


class Followers:
    """Ranks 1..N-1 of one worker's group: started before rank 0 joins, fed every message and step."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.size = spec.engine.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix=f"disagg-tp{spec.dp_rank}-")
        self.rendezvous = f"file://{self._dir}/rendezvous"
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, self.size)]
        self._conns = [send for _, send in pipes]
        self._procs = [context.Process(target=follower_main, args=(spec, rank, self.rendezvous, recv), daemon=True,
                                       name=f"disagg-dp{spec.dp_rank}-tp{rank}")
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
        shutil.rmtree(self._dir, ignore_errors=True)


def follower_main(spec: WorkerSpec, rank: int, rendezvous: str, conn) -> None:
    """A follower process: join the group, build the rank's engine, do what rank 0 does."""
    from disagg.logs import configure_logging

    if spec.cpus is not None:
        os.sched_setaffinity(0, spec.cpus)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(spec.log_format)
    structlog.contextvars.bind_contextvars(dp_rank=spec.dp_rank, tp_rank=rank, pid=os.getpid())
    asyncio.run(_follow(spec, rank, rendezvous, conn))


async def _follow(spec: WorkerSpec, rank: int, rendezvous: str, conn) -> None:
    from disagg.dp.worker import apply, step
    from disagg.engine.core import EngineCore
    from disagg.engine.models.tensor_parallel import init_group

    engine = rank_engine(spec.engine)
    core = EngineCore(engine, tp=init_group(rank, engine.tensor_parallel_size, rendezvous, engine.model.device))
    core.warm_up()  # rank 0 warms up too: the same forward passes, the same collectives
    role = spec.role.build(core, spec.dp_rank, spec.engine.model.served_model_name or core.loaded.name)
    log.info("tensor-parallel follower ready", num_blocks=core.num_blocks)
    while True:
        try:
            msg = await asyncio.to_thread(conn.recv)
        except EOFError:  # rank 0 is gone
            return
        if isinstance(msg, ShutdownMsg):
            return
        if msg == STEP:
            step(role)
        else:
            await apply(role, msg)
