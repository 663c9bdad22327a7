"""A DP engine worker process: connects back to its front, loads the engine, then loops.

Loop: read what arrived (without waiting when there is work), apply it, run one engine step, send
the outputs, and report load twice a second.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from disagg.config import EngineConfig
from disagg.dp.engine_handler import EngineHandler
from disagg.dp.framing import FrameSocket
from disagg.engine.core import EngineCore
from disagg.logs import configure_logging
from disagg.wire.engine_msgs import (
    AbortMsg, GenerateMsg, ShutdownMsg, UtilityMsg, UtilityResultMsg, decode_to_worker, encode,
)

log = structlog.get_logger(__name__)
STATS_INTERVAL_S = 0.5
HandlerFactory = Callable[[EngineCore, int, str], EngineHandler]


@dataclass(frozen=True)
class WorkerSpec:
    dp_rank: int
    engine: EngineConfig
    socket_path: str
    log_format: str = "console"
    handler_factory: HandlerFactory | None = None  # the P/D roles plug their handlers in here


def run_worker(spec: WorkerSpec) -> None:
    """Process entry point (spawned)."""
    configure_logging(spec.log_format)
    structlog.contextvars.bind_contextvars(dp_rank=spec.dp_rank, pid=os.getpid())
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(spec.socket_path)
    channel = FrameSocket(sock)
    log.info("loading engine", model=spec.engine.model.model, dtype=spec.engine.model.dtype)
    core = EngineCore(spec.engine)
    core.warm_up()
    name = spec.engine.model.served_model_name or core.loaded.name
    handler = (spec.handler_factory or EngineHandler)(core, spec.dp_rank, name)
    channel.send(encode(handler.ready_msg()))
    log.info("engine ready", num_blocks=core.num_blocks, max_model_len=core.max_model_len)
    try:
        serve(handler, channel)
    except EOFError:
        log.info("front closed the connection; exiting")
    finally:
        channel.close()


def serve(handler: EngineHandler, channel: FrameSocket) -> None:
    last_stats = 0.0
    while True:
        for data in channel.receive(0.0 if handler.has_work() else STATS_INTERVAL_S):
            msg = decode_to_worker(data)
            if isinstance(msg, ShutdownMsg):
                return
            replies = apply(handler, msg)
            if replies:
                channel.send(*map(encode, replies))
        if handler.has_work():
            channel.send(*map(encode, step(handler)))
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S:
            channel.send(encode(handler.stats()))
            last_stats = now


def apply(handler: EngineHandler, msg) -> list:
    if isinstance(msg, GenerateMsg):
        return handler.submit(msg)
    if isinstance(msg, AbortMsg):
        return handler.abort(msg.request_id)
    if isinstance(msg, UtilityMsg):
        try:
            return [UtilityResultMsg(msg.call_id, result=handler.utility(msg.method, msg.args))]
        except Exception as exc:  # a failed utility is reported, never fatal
            return [UtilityResultMsg(msg.call_id, error=f"{type(exc).__name__}: {exc}")]
    raise AssertionError(f"unexpected message {msg!r}")


def step(handler: EngineHandler) -> list:
    try:
        return handler.step()
    except Exception as exc:  # one failing step fails its requests, not the worker
        log.exception("engine step failed")
        return handler.fail_all(exc)
