"""Kubernetes service discovery: watch the prefill and decode pods and keep the pool in step.

A thin adapter around pods.py (the policy). Per role: list the pods matching the selector, then
watch from the list's resourceVersion; every event goes through `PodTracker` and `reconcile`, and
the actions are applied to the `WorkerPool`. A server is added PENDING and gets requests only after
the router's own `GET /health` succeeds. Errors re-list after a backoff that doubles while failures
come in a row (a watch that runs to its end resets it); a 410 Gone after a healthy watch re-lists
at once, 410s in a row back off like any failure.
Every call has a deadline: a list `api_timeout_s`, a watch `watch_timeout_s` (server side) plus
`api_timeout_s` (client side).

kubernetes_asyncio is imported here only, when `--service-discovery` is given (extra `k8s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import structlog

from disagg.config import ConfigError
from disagg.registry_config import RetryConfig
from disagg.router.config import DiscoveryConfig
from disagg.router.health import HealthChecker
from disagg.router.pods import Action, ActionKind, EventType, PodTracker, pod_view, reconcile
from disagg.router.workers import Role, WorkerPool

log = structlog.get_logger("disagg.router")
MISSING_CLIENT = ("--service-discovery needs the kubernetes_asyncio package: install the extra k8s "
                  "(pip install 'disagg[k8s]')")


class DiscoveryError(Exception):
    """The API server refused a list or watch, or answered something that is not a pod list/event."""


class WatchExpired(DiscoveryError):
    """410 Gone: the resourceVersion is too old; the pods must be listed again."""


EXPECTED_ERRORS = (DiscoveryError, aiohttp.ClientError, asyncio.TimeoutError, ValueError)


def retry_wait_s(retry: RetryConfig, failures: int, expired: bool) -> float:
    """The wait before listing again after `failures` failures in a row (this one not counted): none
    for a first 410 (a watch's history ran out, nothing is wrong), else the doubling backoff."""
    return 0.0 if expired and failures == 0 else retry.backoff_s(failures)


def load_client():
    """The kubernetes_asyncio package; ConfigError naming the extra when it is not installed."""
    try:
        import kubernetes_asyncio
        import kubernetes_asyncio.client
        import kubernetes_asyncio.config
    except ModuleNotFoundError as exc:
        raise ConfigError(MISSING_CLIENT) from exc
    return kubernetes_asyncio


async def open_api(k8s, kubeconfig: str | None):
    """An ApiClient: from `kubeconfig` if given, else the pod's service account, else $KUBECONFIG."""
    configuration = k8s.client.Configuration()
    if kubeconfig is None:
        try:
            k8s.config.load_incluster_config(client_configuration=configuration)
            return k8s.client.ApiClient(configuration)
        except k8s.config.ConfigException:
            pass  # not in a pod: the kubeconfig of whoever runs the router
    await k8s.config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return k8s.client.ApiClient(configuration)


class Discovery:
    """Watches both roles' pods until closed; the pool follows them."""

    def __init__(self, config: DiscoveryConfig, pool: WorkerPool, health: HealthChecker):
        self._config = config
        self._pool = pool
        self._health = health
        self._api = None
        self._core = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Connect to the API server and start one watch per role."""
        k8s = load_client()
        self._api = await open_api(k8s, self._config.kubeconfig)
        self._core = k8s.client.CoreV1Api(self._api)
        for role, selector in ((Role.PREFILL, self._config.prefill_label_selector),
                               (Role.DECODE, self._config.decode_label_selector)):
            self._spawn(self._run(role, selector), f"discovery-{role}")

    async def close(self) -> None:
        """Stop watching; idempotent. Servers already in the pool stay as they are."""
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        api, self._api = self._api, None
        if api is not None:
            await api.close()

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._tasks.discard(done))

    async def _run(self, role: Role, selector: str) -> None:
        tracker = PodTracker(with_bootstrap_port=role is Role.PREFILL)
        retry = RetryConfig(self._config.backoff_s, self._config.max_backoff_s)
        failures = 0  # in a row; a watch that runs to its end resets it
        while True:
            try:
                version = await self._list(role, selector, tracker)
                while True:
                    version = await self._watch(role, selector, tracker, version)
                    failures = 0
            except Exception as exc:  # noqa: BLE001 - a bug must not end discovery either: log it, back off, list again
                wait_s = retry_wait_s(retry, failures, expired=isinstance(exc, WatchExpired))
                failures += 1
                if isinstance(exc, WatchExpired):
                    log.info("pod watch expired (410 Gone); listing again", role=str(role), retry_in_s=wait_s)
                elif isinstance(exc, EXPECTED_ERRORS):
                    log.warning("pod list/watch failed; retrying", role=str(role),
                                error=f"{type(exc).__name__}: {exc}", retry_in_s=wait_s)
                else:
                    log.error("pod discovery failed unexpectedly; retrying", role=str(role), retry_in_s=wait_s,
                              exc_info=exc)
                await asyncio.sleep(wait_s)

    def _call(self, selector: str, timeout_s: float, **params):
        """The list/watch request of the pods (a coroutine giving the raw aiohttp response)."""
        params.update(label_selector=selector, _preload_content=False, _request_timeout=timeout_s)
        if self._config.namespace is None:
            return self._core.list_pod_for_all_namespaces(**params)
        return self._core.list_namespaced_pod(self._config.namespace, **params)

    async def _list(self, role: Role, selector: str, tracker: PodTracker) -> str:
        """List the pods, replace the tracker's view, sync the pool; the list's resourceVersion."""
        resp = await self._call(selector, self._config.api_timeout_s)
        try:
            raw = await resp.read()
        finally:
            resp.release()
        if resp.status != 200:
            raise DiscoveryError(f"listing {role} pods ({selector}) answered {resp.status}: {raw[:200]!r}")
        body = json.loads(raw)
        tracker.replace_all(self._view(pod) for pod in body.get("items") or [])
        self._sync(role, tracker)
        return str(body["metadata"]["resourceVersion"])

    async def _watch(self, role: Role, selector: str, tracker: PodTracker, version: str) -> str:
        """Follow one watch until the server ends it; the last resourceVersion seen."""
        cfg = self._config
        resp = await self._call(selector, cfg.watch_timeout_s + cfg.api_timeout_s, watch=True, resource_version=version,
                                allow_watch_bookmarks=True, timeout_seconds=max(1, round(cfg.watch_timeout_s)))
        try:
            if resp.status == 410:
                raise WatchExpired(f"watch of {role} pods from resourceVersion {version}: 410 Gone")
            if resp.status != 200:
                raise DiscoveryError(f"watching {role} pods answered {resp.status}")
            while line := await resp.content.readline():
                if line.strip():
                    version = self._on_event(role, tracker, json.loads(line), version)
        finally:
            resp.release()
        return version

    def _on_event(self, role: Role, tracker: PodTracker, event: dict, version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            message = f"watch of {role} pods: {code} {obj.get('reason')}: {obj.get('message')}"
            raise WatchExpired(message) if code == 410 else DiscoveryError(message)
        version = str(obj.get("metadata", {}).get("resourceVersion") or version)
        if kind == "BOOKMARK":
            return version
        pod = self._view(obj)
        tracker.apply(EventType(kind), pod)
        log.debug("pod event", role=str(role), change=kind, pod=pod.key, ready=pod.ready, terminating=pod.terminating)
        self._sync(role, tracker)
        return version

    def _view(self, pod: dict):
        return pod_view(pod, self._config.port, self._config.bootstrap_port_annotation)

    def _sync(self, role: Role, tracker: PodTracker) -> None:
        for action in reconcile(tracker.wanted(), self._pool.infos(role)):
            self._apply(role, action)

    def _apply(self, role: Role, action: Action) -> None:
        log.info("discovery: " + action.kind.value, role=str(role), url=action.url, bootstrap_port=action.bootstrap_port)
        if action.kind is ActionKind.DRAIN:
            self._pool.drain(role, action.worker_id)
            return
        if action.kind is ActionKind.ADD:
            worker_id = self._pool.add(role, action.url, action.bootstrap_port)
        else:
            worker_id = action.worker_id
            self._pool.readmit(role, worker_id)
        self._spawn(self._health.check(role, worker_id), f"discovery-check-{role}-{worker_id}")
