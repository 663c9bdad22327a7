"""The DP controller: spawns `dp_size` engine worker processes and serves them to the HTTP layer.

Workers connect back over a Unix socket in a private temp dir and speak msgspec frames. A worker
that dies is noticed (EOF or its process sentinel) within half a second: its requests end with a
503 naming its rank, and it is restarted after a backoff (doubling per quick death) as a new
incarnation: a new process with a new transfer identity. Meanwhile the other workers keep serving,
requests pinned to the dead rank fail fast, and nothing waits on it forever.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import msgspec
import structlog

from disagg.config import DisaggregationMode, LoadBalanceMethod, ServerConfig
from disagg.cpus import format_cpu_list, usable_cpus, worker_cpu_sets
from disagg.engine_config import EngineConfig
from disagg.kv_events_config import KVEventsConfig
from disagg.dp.aggregate import check_results
from disagg.dp.dispatch import Dispatcher, estimate_tokens, routing_prompt
from disagg.dp.faults import PD_FAULTS, WORKER_FAULTS, ProcessFaults
from disagg.wire.framing import frame, read_frame
from disagg.dp.protocol import DispatchStats, ModelCard, UtilityFailed, WorkerState, WorkerUnavailable
from disagg.dp.role_switch import PdRoles, RoleSwitchError, switch_role
from disagg.dp.worker_handle import SentRequest, WorkerHandle, engine_msg
from disagg.worker.process import WorkerSpec, run_worker, worker_context
from disagg.worker.roles import RoleSpec
from disagg.http_edge import HttpError
from disagg.types import FaultKind, FinishReason, InvalidRequest
from disagg.wire.engine_msgs import (
    UTILITY_RESULTS, AbortMsg, GenerateMsg, OutputMsg, ReadyMsg, ShutdownMsg, StatsMsg, StepsMsg, Utility, UtilityMsg,
    UtilityResultMsg, decode_from_worker, encode,
)

log = structlog.get_logger(__name__)
MONITOR_INTERVAL_S = 0.5
FRESH_STATS_TIMEOUT_S = 0.25  # /metrics asks the workers for their load; one in a long step keeps its report
MAX_STEP_REPORTS = 2048  # a worker's every 0.5 s: minutes of them for a /metrics scrape to take


class DPController:
    """Implements disagg.dp.protocol.EngineClient over worker processes."""

    def __init__(self, server: ServerConfig, engine: EngineConfig, role: RoleSpec = RoleSpec(),
                 kv_events: KVEventsConfig = KVEventsConfig(), pd_roles: PdRoles | None = None):
        self.server = server
        self.kv_events = kv_events
        self.dp_size = server.dp_size
        self.load_balance_method = server.load_balance_method
        self.cpu_sets = worker_cpu_sets(server.cpus, server.dp_size, usable_cpus())
        # A pinned worker's threads default to its share of the CPUs (in _spawn); one not pinned gets
        # cores // dp_size.
        threads = engine.num_threads or (None if self.cpu_sets else max(1, (os.cpu_count() or 1) // server.dp_size))
        self.engine_config = replace(engine, num_threads=threads)
        self.role = role
        self.pd_roles = pd_roles  # --enable-pd-role-switch: the role now and the other (disagg/dp/role_switch.py)
        self.dispatcher = Dispatcher(server.load_balance_method, server.dp_size)
        self.workers: list[WorkerHandle] = []
        self.model: ModelCard | None = None
        # Keyed by the id a worker knows a request by: the client's id and a number of its own
        # (`engine_id`), so that what a worker still says about an earlier request of the same id (the
        # abort of a leg the router gave up on, say) never reaches a later one.
        self._streams: dict[str, asyncio.Queue[OutputMsg]] = {}
        self._sent: dict[str, SentRequest] = {}
        self._engine_ids: dict[str, str] = {}  # the client's id of a request in flight -> its engine id
        self._dispatches = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self.faults = ProcessFaults()  # --enable-fault-injection (disagg/dp/faults.py)
        self._tasks: list[asyncio.Task] = []
        self._all_ready = asyncio.Event()
        self._tmpdir = tempfile.mkdtemp(prefix="disagg-dp-")
        self._server: asyncio.AbstractServer | None = None
        self._socket_path = ""
        self._closing = False
        self._step_reports: deque[StepsMsg] = deque(maxlen=MAX_STEP_REPORTS)  # until /metrics takes them
        self._supervising = False

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self, progress: Callable[[str], None] = lambda line: None) -> None:
        """Spawn the workers and wait until every one has loaded its engine (bounded)."""
        path = os.path.join(self._tmpdir, "workers.sock")
        self._server = await asyncio.start_unix_server(self._on_connect, path)
        self._socket_path = path
        self.workers = [WorkerHandle(rank, self._spawn(rank)) for rank in range(self.dp_size)]
        pinned = "" if self.cpu_sets is None else " on CPUs " + " | ".join(map(format_cpu_list, self.cpu_sets))
        progress(f"loading {self.engine_config.model.model} on {self.dp_size} DP worker(s){pinned}")
        self._tasks.append(asyncio.create_task(self._monitor()))
        await self._wait_ready(progress)
        self._supervising = True  # from now on a dead worker is restarted (at start-up it is fatal)

    def worker_spec(self, rank: int) -> WorkerSpec:
        """What the worker of `rank` runs: its engine config, and its CPUs when the server is pinned
        (its torch threads then default to their number)."""
        engine, cpus = self.engine_config.for_dp_rank(rank), None
        if self.cpu_sets is not None:
            cpus = self.cpu_sets[rank]
            engine = replace(engine, num_threads=engine.num_threads or len(cpus))
        switch_roles = {} if self.pd_roles is None else self.pd_roles.worker_roles()
        return WorkerSpec(rank, engine, self._socket_path, self.role, self.server.log_format, self.kv_events, cpus,
                          self.server.enable_fault_injection, switch_roles, self.server.step_metrics_endpoint)

    def _spawn(self, rank: int):
        spec = self.worker_spec(rank)
        process = worker_context().Process(target=run_worker, args=(spec,), name=f"disagg-dp{rank}", daemon=True)
        process.start()
        return process

    async def _wait_ready(self, progress) -> None:
        deadline = time.monotonic() + self.server.worker_start_timeout_s
        while not self._all_ready.is_set():
            dead = [w for w in self.workers if not w.alive]
            if dead:
                raise WorkerUnavailable(f"DP worker {dead[0].rank} exited while loading (exit code {dead[0].process.exitcode})")
            if time.monotonic() > deadline:
                raise WorkerUnavailable(f"DP workers not ready after {self.server.worker_start_timeout_s:.0f} s")
            try:
                await asyncio.wait_for(self._all_ready.wait(), timeout=MONITOR_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
        progress(f"{self.dp_size} DP worker(s) ready")

    async def close(self) -> None:
        self._closing = True
        for worker in self.workers:
            if worker.alive and worker.writer is not None:
                worker.writer.write(frame(encode(ShutdownMsg())))
        for task in self._tasks:
            task.cancel()
        deadline = time.monotonic() + 10
        for worker in self.workers:
            await asyncio.to_thread(worker.process.join, max(deadline - time.monotonic(), 0.1))
            if worker.process.is_alive():
                worker.process.kill()
                await asyncio.to_thread(worker.process.join, 5)
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def __aenter__(self) -> "DPController":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- worker connections -------------------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:  # the loop shuts down (a worker may be loading): re-raised, Python 3.11 logs an "Exception in callback"
            await self._serve_worker(reader, writer)
        except asyncio.CancelledError:
            return

    async def _serve_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ready = decode_from_worker(await read_frame(reader))
        assert isinstance(ready, ReadyMsg), f"first message from a worker must be ReadyMsg, got {ready!r}"
        worker = self.workers[ready.dp_rank]
        worker.writer, worker.ready, worker.ready_at = writer, ready, time.monotonic()
        if worker.num_restarts:
            log.info("DP worker restarted", dp_rank=worker.rank, num_restarts=worker.num_restarts)
        if self.model is None:
            self.model = ModelCard(ready.model_name, ready.max_model_len, ready.vocab_size, ready.engine_summary,
                                   dict(ready.compatibility), self.engine_config.cache.metrics_info(ready.num_blocks),
                                   tuple(ready.eos_token_ids))
        if all(w.ready is not None for w in self.workers):
            self._all_ready.set()
        try:
            while True:
                self._on_message(worker, decode_from_worker(await read_frame(reader)))
        except (asyncio.IncompleteReadError, ConnectionError):
            self._mark_dead(worker, "closed its connection")

    def _on_message(self, worker: WorkerHandle, msg) -> None:
        if isinstance(msg, OutputMsg):
            queue = self._streams.get(msg.request_id)
            if queue is not None:
                queue.put_nowait(msg)
            sent = self._sent.get(msg.request_id)
            if sent is not None and self.migrates and self.server.migration_limit:  # what a migration resends
                sent.token_ids += msg.new_token_ids
            if msg.finish_reason is not None or msg.error is not None:
                worker.outstanding.pop(msg.request_id, None)
        elif isinstance(msg, UtilityResultMsg):
            future = self._calls.pop(msg.call_id, None)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, StatsMsg):
            worker.stats = msg
        elif isinstance(msg, StepsMsg):
            self._step_reports.append(msg)

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            for worker in self.workers:
                if worker.alive and not worker.process.is_alive():
                    self._mark_dead(worker, f"exited with code {worker.process.exitcode}")

    def _mark_dead(self, worker: WorkerHandle, how: str) -> None:
        if not worker.alive:
            return
        worker.alive = False
        worker.down_reason = how
        if self._closing:
            return
        log.error("DP worker died", dp_rank=worker.rank, how=how)
        error = f"DP worker {worker.rank} died ({how})"
        for request_id, estimate in list(worker.outstanding.items()):
            queue = self._streams.get(request_id)
            if queue is not None and not self._migrate(request_id, estimate, worker):
                queue.put_nowait(OutputMsg(request_id, finish_reason=FinishReason.ABORT, error=error, error_status=503))
        worker.outstanding.clear()
        if self._supervising:
            self._tasks.append(asyncio.create_task(self._restart(worker)))

    def _migrate(self, request_id: str, estimate: int, dead: WorkerHandle) -> bool:
        """Send a request of a dead worker to the least loaded live one, within the migration limit.
        The client sees one stream: the new worker emits only what follows the tokens already sent."""
        sent = self._sent.get(request_id)
        live = [w for w in self.workers if w is not dead and w.available]
        if not self.migrates or sent is None or sent.num_migrations >= self.server.migration_limit or not live:
            return False
        if self.mode is DisaggregationMode.DECODE and not sent.token_ids:
            return False  # its KV never arrived: its prefill's room failed with it (a router sends it again)
        target = min(live, key=lambda w: (sum(w.outstanding.values()), w.rank))
        target.send(sent.resumed())
        target.outstanding[request_id] = estimate
        sent.worker, sent.num_migrations = target, sent.num_migrations + 1
        log.warning("request migrated to another DP worker", request_id=request_id, from_rank=dead.rank,
                    to_rank=target.rank, num_tokens_done=len(sent.token_ids))
        return True

    async def _restart(self, dead: WorkerHandle) -> None:
        """Start the next incarnation of a dead rank after its backoff (unless closing)."""
        delay_s, quick = dead.restart_backoff_s(self.server)
        log.info("restarting DP worker", dp_rank=dead.rank, backoff_s=delay_s)
        await asyncio.sleep(delay_s)
        if self._closing:
            return
        if dead.process.is_alive():  # it closed its connection but runs on: never two workers on one rank
            dead.process.kill()
        await asyncio.to_thread(dead.process.join, 5)  # reap it
        worker = WorkerHandle(dead.rank, self._spawn(dead.rank), dead.num_restarts + 1, dead.down_reason)
        worker.num_quick_deaths = quick
        self.workers[dead.rank] = worker

    # ---- EngineClient -------------------------------------------------------------------------

    def pick_rank(self, routed_dp_rank: int | None, bootstrap_room: int | None, msg: GenerateMsg | None = None) -> int:
        loads = [sum(w.outstanding.values()) for w in self.workers]
        prompt = routing_prompt(msg) if msg is not None and self.dispatcher.method is LoadBalanceMethod.CACHE_AWARE else ""
        return self.dispatcher.pick(routed_dp_rank, bootstrap_room, loads, [w.available for w in self.workers], prompt)

    def dispatch_stats(self) -> DispatchStats:
        return DispatchStats(self.dispatcher.num_cache_hits, self.dispatcher.num_cache_misses)

    async def generate(self, msg: GenerateMsg, dp_rank: int) -> AsyncIterator[OutputMsg]:
        """Outputs of one request; leaving the loop early (disconnect, error) aborts it."""
        worker = self.workers[self.dispatcher.check_rank(dp_rank)]
        if not worker.available:
            raise WorkerUnavailable(worker.unavailable_reason())
        if (status := self.faults.take_failure(dp_rank)) is not None:
            yield OutputMsg(msg.request_id, finish_reason=FinishReason.ABORT, error_status=status,
                            error=f"injected fault: DP worker {dp_rank} answers {status}")
            return
        if msg.request_id in self._engine_ids:
            raise InvalidRequest(f"request id {msg.request_id!r} is already in use", "request_id")
        external, msg = msg.request_id, engine_msg(msg, next(self._dispatches))
        engine_id = msg.request_id
        queue: asyncio.Queue[OutputMsg] = asyncio.Queue()
        self._engine_ids[external] = engine_id
        self._streams[engine_id] = queue
        sent = self._sent[engine_id] = SentRequest(msg, worker)
        finished = False
        try:
            worker.send(msg)
            worker.outstanding[engine_id] = estimate_tokens(msg, self.model.max_model_len if self.model else 0)
            while not finished:
                out = await queue.get()
                finished = out.finish_reason is not None or out.error is not None
                yield msgspec.structs.replace(out, request_id=external)
        finally:
            self._engine_ids.pop(external, None)
            self._streams.pop(engine_id, None)
            self._sent.pop(engine_id, None)
            worker = sent.worker  # where it runs now (a migration moved it)
            if not finished and worker.available:
                worker.outstanding.pop(engine_id, None)
                worker.send(AbortMsg(engine_id))

    async def inject_fault(self, kind: FaultKind, dp_rank: int, params: dict) -> None:
        """One fault on the worker of `dp_rank` (checked by faults.check_fault; docs/testing.md)."""
        worker = self.workers[self.dispatcher.check_rank(dp_rank)]
        if kind in PD_FAULTS and self.mode is DisaggregationMode.NULL:
            raise InvalidRequest(f"{kind}: this server moves no KV (a unified server)", "fault")
        if kind in WORKER_FAULTS:
            await self.call_utility(Utility.INJECT_FAULT, kind, params, ranks=[dp_rank])
        else:
            self.faults.apply(kind, dp_rank, worker.process.pid, params)

    async def abort(self, request_id: str) -> bool:
        """Abort the request in flight under the client's id `request_id`; False when none is."""
        engine_id = self._engine_ids.get(request_id)
        for worker in self.workers:
            if engine_id is not None and engine_id in worker.outstanding and worker.available:
                worker.send(AbortMsg(engine_id))
                return True
        return False

    async def call_utility(self, method: Utility, *args, ranks: list[int] | None = None, timeout_s: float = 60.0) -> list[object]:
        """Run `method` on every worker (or on `ranks`); one result per worker, typed by UTILITY_RESULTS
        (errors raise UtilityFailed)."""
        method = Utility(method)
        futures = []
        for worker in self.workers if ranks is None else [self.workers[r] for r in ranks]:
            call_id = next(self._call_ids)
            future = self._calls[call_id] = asyncio.get_running_loop().create_future()
            futures.append(future)
            try:
                worker.send(UtilityMsg(call_id, method, list(args)))
            except WorkerUnavailable as exc:
                future.set_result(UtilityResultMsg(call_id, error=str(exc)))
        done = await asyncio.wait_for(asyncio.gather(*futures), timeout=timeout_s)
        results = check_results(method, done)
        kind = UTILITY_RESULTS.get(method)
        return results if kind is None else [msgspec.convert(r, kind) for r in results]

    async def settle(self, timeout_s: float, hurry: asyncio.Event | None = None) -> int:
        """Drain, once no HTTP request is in flight: wait up to `timeout_s` (less if `hurry` is set)
        for work the workers keep past their answers. Returns how much of it was left (roles
        override it: the prefill's leases); none here."""
        return 0

    def take_step_reports(self) -> list[StepsMsg]:
        """The workers' per-step reports since the last call (the last MAX_STEP_REPORTS at most)."""
        reports = list(self._step_reports)
        self._step_reports.clear()
        return reports

    async def refresh_stats(self, timeout_s: float = FRESH_STATS_TIMEOUT_S) -> None:
        """Each available worker's load now (its last periodic report is up to STATS_INTERVAL_S old);
        one that does not answer within `timeout_s` (in a long step) keeps its last report."""
        async def ask(worker: WorkerHandle) -> None:
            try:
                [worker.stats] = await self.call_utility(Utility.STATS, ranks=[worker.rank], timeout_s=timeout_s)
            except (asyncio.TimeoutError, UtilityFailed):
                pass
        await asyncio.gather(*(ask(w) for w in self.workers if w.available))

    def worker_states(self) -> list[WorkerState]:
        return [w.state() for w in self.workers]

    def healthy(self) -> bool:
        failed = self.pd_roles is not None and self.pd_roles.failure is not None
        return bool(self.workers) and all(w.available for w in self.workers) and not failed

    @property
    def migrates(self) -> bool:
        """A request whose worker died goes on on another (ServerConfig.migration_limit); never on a
        prefill: a room's KV lives on the rank that computed it (a dead rank's request fails, 503)."""
        return self.mode is not DisaggregationMode.PREFILL

    async def switch_role(self, new_mode: DisaggregationMode, timeout_s: float, in_flight: Callable[[], int] | None = None,
                          hand_back: Callable[[HttpError], Awaitable[int]] | None = None) -> bool:
        """`POST /pd_role_switch`: the whole server to `new_mode` (disagg/dp/role_switch.py); False when
        it runs it already. Then the DP pick is that mode's, and a restarted worker starts in it.
        `in_flight` counts the requests the server accepted (the front's, from admission on; default:
        those sent to a worker); `hand_back` ends those that sent nothing yet (role_switch.switch_role)."""
        if self.pd_roles is None:
            raise RoleSwitchError("this server runs without --enable-pd-role-switch", 400)
        switched = await switch_role(self.pd_roles, new_mode, timeout_s=timeout_s,
                                     in_flight=in_flight or (lambda: len(self._streams)), call=self.call_utility,
                                     hand_back=hand_back)
        if switched:
            self.role, self.load_balance_method = self.pd_roles.spec, self.pd_roles.methods[new_mode]
            self.dispatcher = Dispatcher(self.load_balance_method, self.dp_size)
        return switched

    @property
    def mode(self) -> DisaggregationMode:
        """The role the server plays now (a role switch changes it)."""
        return self.server.disaggregation_mode if self.pd_roles is None else self.pd_roles.mode

    @property
    def role_info(self) -> dict:
        """What /server_info says of the role (its RoleSpec's info; the role epoch with switching on)."""
        return self.role.info if self.pd_roles is None else {**self.role.info, **self.pd_roles.info()}

