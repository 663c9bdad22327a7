"""The role planner at work in our router (`--planner advisory|auto`): every `--planner-interval-s` it
reads each admitting server's /metrics (its `disagg_engine_step_*` counters), hands the interval's
growth per role to the pure Planner (disagg/router/planner.py), exports the decision as
`disagg_planner_*` on the router's /metrics, and in `auto` mode switches one server started with
`--enable-pd-role-switch` (`POST /pd_role_switch`, with the admin key of DISAGG_ADMIN_KEY) once a
proposal is confirmed. The router then follows the switch as it follows any (disagg/router/health.py).
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from disagg.router.config import PlannerConfig, PlannerMode
from disagg.router.planner import Action, Decision, Planner, RoleLoad, StepSums, parse_step_sums
from disagg.router.workers import Role, WorkerInfo, WorkerPool

log = structlog.get_logger("disagg.router")
SWITCH_TIMEOUT_S = 120.0  # a switch waits for its server's accepted work (its --pd-role-switch-timeout-s)


def rejected_total(registry: CollectorRegistry) -> float:
    """The router's 429 answers so far (`smg_http_responses_total{status_code="429"}`: admission turned them away)."""
    return sum(sample.value for metric in registry.collect() if metric.name == "smg_http_responses"
               for sample in metric.samples
               if sample.name.endswith("_total") and sample.labels.get("status_code") == "429")


def _said(load: RoleLoad, infos: list[WorkerInfo]) -> dict:
    """A role's interval as the decision's log line gives it, and the requests in flight on its servers now."""
    steps = load.steps
    return {"servers": load.num_servers, "in_flight": sum(info.in_flight for info in infos),
            "steps": round(steps.num_steps), "step_ms": round(load.step_s * 1e3, 1),
            "prompt_tokens": round(steps.prefill_tokens),
            "decode_seqs_a_step": round(load.work, 2) if steps.decode_seqs else 0.0, "waiting": round(steps.waiting)}


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.servers = Gauge("disagg_planner_servers", "the role mix the planner's last decision leads to",
                             ["role"], registry=registry)
        self.ttft = Gauge("disagg_planner_estimated_ttft_seconds", "the planner's TTFT estimate", registry=registry)
        self.itl = Gauge("disagg_planner_estimated_itl_seconds", "the planner's ITL estimate", registry=registry)
        self.predicted = Gauge("disagg_planner_predicted_seconds", "the planner's fitted TTFT and ITL for the role "
                               "mix its last decision leads to", ["metric"], registry=registry)
        self.decisions = Counter("disagg_planner_decisions", "the planner's decisions by action, and whether it "
                                 "acted on them", ["action", "confirmed"], registry=registry)
        self.last = Gauge("disagg_planner_last_decision", "1 for the planner's last decision (action, reason)",
                          ["action", "reason"], registry=registry)

    def record(self, decision: Decision) -> None:
        self.servers.labels("prefill").set(decision.num_prefill)
        self.servers.labels("decode").set(decision.num_decode)
        self.ttft.set(decision.est_ttft_s)
        self.itl.set(decision.est_itl_s)
        self.predicted.labels("ttft").set(decision.predicted_ttft_s)
        self.predicted.labels("itl").set(decision.predicted_itl_s)
        self.decisions.labels(decision.action.value, str(decision.confirmed).lower()).inc()
        self.last.clear()
        self.last.labels(decision.action.value, decision.reason).set(1)


class RolePlanner:
    """Reads, decides, exports and (auto) switches every interval until closed."""

    def __init__(self, config: PlannerConfig, pool: WorkerPool, session: aiohttp.ClientSession,
                 registry: CollectorRegistry, timeout_s: float, admin_key: str | None, whole_local: bool = False):
        self.config, self._pool, self._session, self._timeout_s = config, pool, session, timeout_s
        self._admin_key = admin_key
        self._whole_local = whole_local  # the router sends decodes whole prompts while no prefill serves (cache_aware)
        self._moved_to_decode: list[str] = []  # the prefills this planner made decodes, latest last
        self._registry = registry
        self._rejected = rejected_total(registry)  # the router's 429 answers so far
        self.planner = Planner(config.ttft_slo_ms / 1e3, config.itl_slo_ms / 1e3)
        self.metrics = PlannerMetrics(registry)
        self.last: Decision | None = None
        self._seen: dict[str, StepSums] = {}  # url -> its counters at the last read
        self._task: asyncio.Task | None = None
        self._switching: asyncio.Task | None = None

    def start(self) -> None:
        if self.config.planner is not PlannerMode.OFF:
            self._task = asyncio.create_task(self._loop(), name="router-planner")

    async def close(self) -> None:
        for task in (self._task, self._switching):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._switching = None

    async def _loop(self) -> None:
        await self.run_once()  # the first reading now: the first decision comes one interval after start
        while True:
            await asyncio.sleep(self.config.planner_interval_s)
            await self.run_once()

    async def run_once(self) -> Decision | None:
        """One interval: None while a switch runs or before every server was read once."""
        if self._switching is not None and not self._switching.done():
            return None
        loads = {role: await self._role_load(role) for role in Role}
        if any(load is None for load in loads.values()):
            return None
        now = rejected_total(self._registry)
        rejected, self._rejected = now - self._rejected, now
        decision = self.planner.decide(loads[Role.PREFILL], loads[Role.DECODE], self._decodes_prefill(),
                                       round(rejected))
        self.metrics.record(decision)
        if decision.action is not Action.HOLD or decision != self.last:
            log.info("planner decision", action=decision.action.value, reason=decision.reason,
                     confirmed=decision.confirmed, mode=self.config.planner.value, rejected=round(rejected),
                     **{role.value: _said(loads[role], self._pool.infos(role)) for role in Role})
        self.last = decision
        if decision.confirmed and self.config.planner is PlannerMode.AUTO:
            self._switch(decision.action)
        return decision

    def _decodes_prefill(self) -> bool:
        """With no prefill, would the decodes serve? Our router's cache_aware pick sends whole prompts to
        the decodes that prefill locally (their --max-local-prefill-tokens); every admitting one must."""
        loads = [load for load in self._pool.loads(Role.DECODE) if load.eligible]
        return self._whole_local and bool(loads) and all(load.max_local_prefill_tokens > 0 for load in loads)

    async def _role_load(self, role: Role) -> RoleLoad | None:
        """The role's admitting servers' growth since the last read (None: one was read for the first time)."""
        infos = [info for info in self._pool.infos(role) if info.admitting]
        total, first = StepSums(), False
        readings = await asyncio.gather(*(self._read(info.url) for info in infos))  # each within its timeout
        for info, now in zip(infos, readings):
            if now is None:
                continue
            earlier = self._seen.get(info.url)
            self._seen[info.url] = now
            if earlier is None:
                first = True
                continue
            grown = now.since(earlier)
            total = StepSums(total.num_steps + grown.num_steps, total.wall_s + grown.wall_s,
                             total.prefill_tokens + grown.prefill_tokens, total.decode_seqs + grown.decode_seqs,
                             total.waiting + grown.waiting)
        return None if first else RoleLoad(len(infos), self.config.planner_interval_s, total)

    async def _read(self, url: str) -> StepSums | None:
        try:
            async with self._session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=self._timeout_s)) as r:
                return parse_step_sums(await r.text()) if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    def _switch(self, action: Action) -> None:
        """Switch the least busy switchable server of the role the action takes one from."""
        role, new_role = ((Role.PREFILL, Role.DECODE) if action is Action.PREFILL_TO_DECODE
                          else (Role.DECODE, Role.PREFILL))
        candidates = [info for info in self._pool.infos(role) if info.admitting and info.role_epoch is not None]
        if not candidates:
            log.warning("planner: no server of the role can switch (--enable-pd-role-switch)", role=str(role))
            return
        # Back to prefill: the server this planner made a decode last (its engine was sized to prefill).
        back = {url: i for i, url in enumerate(self._moved_to_decode)} if role is Role.DECODE else {}
        target = min(candidates, key=lambda info: (-back.get(info.url, -1), info.in_flight, info.index))
        if role is Role.PREFILL:
            self._moved_to_decode = [url for url in self._moved_to_decode if url != target.url] + [target.url]
        elif target.url in back:
            self._moved_to_decode.remove(target.url)
        self._switching = asyncio.create_task(self._post_switch(target.url, new_role))

    async def _post_switch(self, url: str, new_role: Role) -> None:
        headers = {} if self._admin_key is None else {"Authorization": f"Bearer {self._admin_key}"}
        try:
            async with self._session.post(url + "/pd_role_switch", json={"new_role": new_role.value}, headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=SWITCH_TIMEOUT_S)) as r:
                log.info("planner switched a server", url=url, new_role=new_role.value, status=r.status,
                         answer=(await r.text())[:200])
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.warning("planner: the switch failed", url=url, new_role=new_role.value, error=str(exc))
