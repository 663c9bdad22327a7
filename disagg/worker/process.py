"""A DP engine worker process: connects back to its front, loads the engine, then loops.

The worker is one asyncio program. Each turn: take what arrived (without waiting when there is
work), apply it, let the role advance its background work (KV transfers in the P/D roles), run
one engine step, send the outputs; report load twice a second. The engine step runs in a thread
while the loop awaits it: only the loop's I/O (sockets, gRPC streams, queued events) goes on
meanwhile; every role method is still called from the loop, one at a time.

All torch work (loading, warm-up, every step, utility calls) runs on one thread, `engine_thread`. OpenMP keeps a
team of threads per thread that opens parallel regions; once a second team exists there are more
OpenMP threads than cores, libgomp stops spinning between regions, and every region pays a wake-up
(a batch-1 SmolLM2 token took 12 ms served against 6.2 ms in the engine alone, on 2 cores).
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from disagg.engine_config import EngineConfig
from disagg.wire.framing import frame, read_frame
from disagg.worker.kv_events import ZmqEventPublisher, open_publisher
from disagg.worker.tp_group import Followers, MirroredCore, ignore_stop_signals, rank_cpus, rank_engine
from disagg.kv_events_config import KVEventsConfig
from disagg.logs import configure_logging
from disagg.worker.outputs import admission_error
from disagg.worker.step_reports import StepReporter
from disagg.worker.role import Role, RoomRole
from disagg.wire.engine_msgs import (
    AbortMsg, GenerateMsg, RoomFailedMsg, RoomPlacedMsg, ShutdownMsg, Utility, UtilityMsg, UtilityResultMsg,
    decode_to_worker, encode,
)

if TYPE_CHECKING:
    from disagg.worker.roles import RoleSpec

log = structlog.get_logger(__name__)
STATS_INTERVAL_S = 0.5
WAKE = object()


@dataclass(frozen=True)
class WorkerSpec:
    dp_rank: int
    engine: EngineConfig
    socket_path: str
    role: RoleSpec  # which role the worker builds (disagg/worker/roles.py)
    log_format: str = "console"
    kv_events: KVEventsConfig = KVEventsConfig()  # the server's; the worker offsets its endpoints by dp_rank
    cpus: frozenset[int] | None = None  # the CPUs this worker runs on (None: not pinned)
    faults: bool = False  # the server's --enable-fault-injection
    # --enable-pd-role-switch: the role of each mode ("prefill", "decode") this worker may switch to
    switch_roles: dict[str, RoleSpec] = field(default_factory=dict)
    step_metrics_endpoint: str | None = None  # the server's --step-metrics-endpoint (offset by dp_rank here)


class RoleSlot:
    """The role a worker runs now, and the roles it may switch to (`WorkerSpec.switch_roles`)."""

    def __init__(self, role: Role, spec: WorkerSpec, model_name: str):
        self.role, self._spec, self._model_name = role, spec, model_name

    async def switch(self, mode: str) -> None:
        """Run the role of `mode` on the same engine: its weights, KV cache and prefix cache stay. The
        role now must hold nothing (the front waits for that first); it closes (its transfer endpoints,
        its registry entry's refresh), the new one starts. A start that fails leaves no role: the
        front turns the server unhealthy."""
        target = self._spec.switch_roles.get(mode)
        if target is None:
            raise ValueError(f"this worker cannot become {mode}: its server runs without --enable-pd-role-switch")
        if (held := self.role.holding()) is not None:
            raise RuntimeError(f"the role still holds {held}")
        old = self.role
        await old.close()
        new = target.build(old.core, self._spec.dp_rank, self._model_name)
        new.fault_injection, new.wake, new.step_delay_s = old.fault_injection, old.wake, old.step_delay_s
        await new.start()
        self.role = new
        log.info("role switched", mode=mode, role=type(new).__name__)


# What a worker imports before it loads its engine: a fork server imports it once, and each worker
# starts as a fork of that server (tens of milliseconds) instead of a fresh interpreter that imports
# torch again (about 2 s of CPU on a 2-core host, at every start and every restart). The fork server
# holds no threads, sockets or engine state: only modules; nothing there reads the environment.
WORKER_PRELOAD = ["torch", "disagg.worker.process", "disagg.engine.core"]


@functools.cache
def worker_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context DP workers start from (one fork server per front process)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WORKER_PRELOAD)
    return context


def run_worker(spec: WorkerSpec) -> None:
    """Process entry point (forked from the fork server of worker_context)."""
    if spec.cpus is not None:
        # First, on the only thread there is: every thread started later (the engine thread, torch's
        # OpenMP team, sized from this mask unless num_threads says otherwise) inherits the mask. A
        # TP group's rank 0 takes its share; each follower pins itself to its own.
        os.sched_setaffinity(0, rank_cpus(spec, 0))
    # Ctrl-C (and a SIGTERM sent to the process group: systemd's default, `kill -TERM -PGID`) reaches
    # every process; the front drains and shuts workers down in order instead. A worker that died of
    # the signal would be restarted by the draining front (a prefill took 14 s to stop).
    ignore_stop_signals()
    configure_logging(spec.log_format)
    structlog.contextvars.bind_contextvars(dp_rank=spec.dp_rank, pid=os.getpid())
    try:
        asyncio.run(_main(spec))
    except (EOFError, asyncio.IncompleteReadError, ConnectionError):
        log.info("front closed the connection; exiting")


async def _main(spec: WorkerSpec) -> None:
    reader, writer = await asyncio.open_unix_connection(spec.socket_path)
    log.info("loading engine", model=spec.engine.model.model, dtype=spec.engine.model.dtype,
             tensor_parallel_size=spec.engine.tensor_parallel_size)
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    followers = None
    if spec.engine.tensor_parallel_size > 1:  # this process is rank 0 of a TP group (tp_group.py)
        followers = Followers(spec)
        followers.start()
    try:
        await _run(spec, reader, writer, engine_thread, followers)
    finally:
        if followers is not None:
            followers.close()


async def _run(spec: WorkerSpec, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
               engine_thread: ThreadPoolExecutor, followers: Followers | None) -> None:
    core = await asyncio.get_running_loop().run_in_executor(engine_thread, _load_engine, spec.engine, followers)
    if followers is not None:
        followers.unlink_kv_file()  # rank 0 warmed up with every rank: each has mapped it
        core = MirroredCore(core, followers)
    name = spec.engine.model.served_model_name or core.loaded.name
    role = spec.role.build(core, spec.dp_rank, name)
    role.fault_injection = spec.faults
    events = open_publisher(spec.kv_events, spec.dp_rank, core)
    await role.start()
    slot = RoleSlot(role, spec, name)
    steps = StepReporter(spec.dp_rank, spec.step_metrics_endpoint)
    try:
        writer.write(frame(encode(role.ready_msg())))
        log.info("engine ready", num_blocks=core.num_blocks, max_model_len=core.max_model_len)
        await serve(slot, reader, writer, engine_thread, events, followers, steps)
    finally:
        steps.close()
        await slot.role.close()
        if events is not None:
            events.close()
        writer.close()
        engine_thread.shutdown(wait=False)


def _load_engine(config: EngineConfig, followers: Followers | None = None):
    """The engine, warmed up; with `followers` (tensor parallelism), rank 0's of their group."""
    from disagg.engine.core import EngineCore  # torch loads here, in the worker only
    from disagg.engine.models.tensor_parallel import init_group

    if followers is None:
        core = EngineCore(config)
    else:
        config = rank_engine(config)
        tp = init_group(0, config.tensor_parallel_size, followers.rendezvous, config.model.device)
        core = EngineCore(config, tp=tp, kv_file=followers.kv_file)
    core.warm_up()
    return core


async def _read_into(inbox: asyncio.Queue, reader: asyncio.StreamReader) -> None:
    try:
        while True:
            inbox.put_nowait(decode_to_worker(await read_frame(reader)))
    except (asyncio.IncompleteReadError, ConnectionError):
        inbox.put_nowait(ShutdownMsg())


async def serve(slot: RoleSlot, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                engine_thread: ThreadPoolExecutor, events: ZmqEventPublisher | None = None,
                followers: Followers | None = None, steps: StepReporter | None = None) -> None:
    """The worker loop over `slot.role` (a role switch replaces it between messages); with `followers`
    (tensor parallelism), the role's engine is a MirroredCore and the loop watches that every follower lives."""
    inbox: asyncio.Queue = asyncio.Queue()
    slot.role.wake = lambda: inbox.put_nowait(WAKE)  # background tasks end the idle wait early
    reading = asyncio.create_task(_read_into(inbox, reader))
    loop = asyncio.get_running_loop()
    last_stats = 0.0
    try:
        while True:
            role = slot.role
            for msg in await _take(inbox, 0.0 if role.has_work() else role.idle_wait_s(STATS_INTERVAL_S)):
                if isinstance(msg, ShutdownMsg):
                    return
                if msg is WAKE:
                    continue
                _send(role, writer, await _on_message(slot, msg, engine_thread))
                role = slot.role  # a switch_role call replaced it
            _send(role, writer, await role.poll())
            if followers is not None and not followers.alive():
                raise RuntimeError("a tensor-parallel follower died: the group goes down with it")
            if role.has_work():
                # In a thread, so the loop keeps serving sockets and gRPC streams while torch computes
                # (a decode's TransferInfo must not wait for a run of engine steps to go out).
                _send(role, writer, await loop.run_in_executor(engine_thread, step, role))
                _send(role, writer, await role.poll())  # blocks the step just computed go out now
            if events is not None:  # what this turn's steps, utilities and transfers did to the prefix cache
                events.publish(role.core.take_kv_events())
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:  # the load, and the steps since the last report
                report = None if steps is None else steps.report(role.core.take_step_metrics())
                _send(role, writer, [role.stats()] + ([] if report is None else [report]))
                last_stats = now
            await writer.drain()
    finally:
        reading.cancel()


async def _on_message(slot: RoleSlot, msg, engine_thread: ThreadPoolExecutor) -> list:
    if isinstance(msg, UtilityMsg) and msg.method is Utility.SWITCH_ROLE:  # on the loop: roles start there
        return [await _switch(slot, msg)]
    return await apply(slot.role, msg, engine_thread)


async def _switch(slot: RoleSlot, msg: UtilityMsg) -> UtilityResultMsg:
    """The answer to a switch_role call: None when the worker runs the new role, else what stopped it."""
    try:
        await slot.switch(*msg.args)
        return UtilityResultMsg(msg.call_id, result=None)
    except Exception as exc:  # reported to the front, which decides what the server does next
        log.exception("role switch failed", args=msg.args)
        return UtilityResultMsg(msg.call_id, error=f"{type(exc).__name__}: {exc}")


async def _take(inbox: asyncio.Queue, timeout_s: float) -> list:
    if inbox.empty() and timeout_s > 0:
        try:
            return [await asyncio.wait_for(inbox.get(), timeout_s)] + _drain(inbox)
        except asyncio.TimeoutError:
            return []
    await asyncio.sleep(0)  # let sockets and streams run between engine steps
    return _drain(inbox)


def _drain(inbox: asyncio.Queue) -> list:
    out = []
    while not inbox.empty():
        out.append(inbox.get_nowait())
    return out


def _send(role: Role, writer: asyncio.StreamWriter, msgs: list) -> None:
    role.sent(msgs)
    if msgs:
        writer.write(b"".join(frame(encode(m)) for m in msgs))


async def apply(role: Role, msg, engine_thread: ThreadPoolExecutor | None = None) -> list:
    """Apply one message from the front. A message that raises never stops the loop: a request
    that could not be admitted answers with a 500 naming the exception; a failed abort is logged.
    Utility calls (sleep, wake-up, cache resets: torch work) run on `engine_thread` when given."""
    try:
        return await _apply(role, msg, engine_thread)
    except Exception as exc:  # noqa: BLE001 - the roles answer their own errors; this is the backstop
        if isinstance(msg, GenerateMsg):
            return [admission_error(msg.request_id, exc)]
        log.exception("applying a message failed", message=type(msg).__name__)
        return []


async def _apply(role: Role, msg, engine_thread: ThreadPoolExecutor | None) -> list:
    if isinstance(msg, GenerateMsg):
        role.note(msg)
        return await role.submit(msg)
    if isinstance(msg, AbortMsg):
        return await role.abort(msg.request_id)
    if isinstance(msg, (RoomFailedMsg, RoomPlacedMsg)):  # only a prefill front sends them
        assert isinstance(role, RoomRole), f"{type(msg).__name__} reached a {type(role).__name__}, which holds no rooms"
        if isinstance(msg, RoomFailedMsg):
            return await role.room_failed(msg.bootstrap_room, msg.reason, msg.decode)
        return role.room_placed(msg.bootstrap_room, msg.dp_rank)
    if isinstance(msg, UtilityMsg):
        try:
            result = await _on_engine_thread(engine_thread, role.utility, msg.method, msg.args)
            return [UtilityResultMsg(msg.call_id, result=result)]
        except Exception as exc:  # a failed utility is reported, never fatal
            return [UtilityResultMsg(msg.call_id, error=f"{type(exc).__name__}: {exc}")]
    raise AssertionError(f"unexpected message {msg!r}")


async def _on_engine_thread(engine_thread: ThreadPoolExecutor | None, fn, *args):
    if engine_thread is None:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(engine_thread, fn, *args)


def step(role: Role) -> list:
    """One engine step. A step that raises fails its requests, not the worker; on a rank of a
    tensor-parallel group it takes the worker down (its ranks' collectives no longer match): the
    controller then fails its requests as a dead worker's (503) and restarts the group."""
    if role.step_delay_s:
        time.sleep(role.step_delay_s)  # a slow_steps fault (disagg/dp/faults.py)
    try:
        return role.step()
    except Exception as exc:
        if role.core.tp is not None:
            raise
        log.exception("engine step failed")
        return role.fail_all(exc)
