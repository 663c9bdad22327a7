"""A local fake of the Kubernetes API's pod list and watch, on 127.0.0.1 (port 0).

It speaks what the router's discovery uses, as the API server does:
- `GET /api/v1/namespaces/NS/pods?labelSelector=a=b,c=d` (and `/api/v1/pods`): a PodList whose
  `metadata.resourceVersion` is the current version;
- the same with `watch=true&resourceVersion=RV&timeoutSeconds=N`: JSON lines
  `{"type": "ADDED"|"MODIFIED"|"DELETED", "object": pod}` for every change after RV, then the live
  ones, until N seconds pass; an RV older than the kept history gets one
  `{"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", ...}}`.
Tests change pods with `put` / `delete`, cut live watches with `expire_watches` (history dropped:
resuming watches get 410), and make the next lists fail with `fail_lists`.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

from aiohttp import web


def ready_pod(name: str, port: int, labels: dict[str, str], *, ready: bool = True, deleting: bool = False,
              ip: str = "127.0.0.1", bootstrap_port: int | None = None, namespace: str = "disagg") -> dict:
    """A pod as the API describes it: one container whose port `http` is `port` (and `bootstrap`)."""
    ports = [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    if bootstrap_port is not None:
        ports.append({"name": "bootstrap", "containerPort": bootstrap_port, "protocol": "TCP"})
    metadata = {"name": name, "namespace": namespace, "labels": dict(labels), "uid": f"uid-{name}-{port}"}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "kind": "Pod", "apiVersion": "v1", "metadata": metadata,
        "spec": {"containers": [{"name": "server", "image": "disagg", "ports": ports}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKube:
    """Pods of any namespace, a resourceVersion counter and the change history watches replay."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict] = {}
        self.version = 100
        self.history: list[tuple[int, str, dict]] = []
        self.oldest_kept = 100  # a watch from an older version gets 410 Gone
        self.requests: list[str] = []  # "list" / "watch RV" in arrival order
        self._failing_lists = 0
        self._watchers: set[asyncio.Queue] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> FakeKube:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._pods)
        app.router.add_get("/api/v1/pods", self._pods)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        for queue in self._watchers:
            queue.put_nowait(None)
        if self._runner is not None:
            await self._runner.cleanup()

    def write_kubeconfig(self, path: Path) -> str:
        """A kubeconfig that points kubernetes_asyncio at this fake (plain HTTP, a dummy token)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "disagg"}}],
        }
        path.write_text(json.dumps(config))
        return str(path)

    # --- changes -----------------------------------------------------------------------------------

    def put(self, pod: dict) -> None:
        """Create or replace a pod (ADDED or MODIFIED)."""
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        self._record("MODIFIED" if key in self.pods else "ADDED", pod)
        self.pods[key] = self.history[-1][2]

    def delete(self, name: str, namespace: str = "disagg") -> None:
        """Remove a pod (DELETED)."""
        self._record("DELETED", self.pods.pop((namespace, name)))

    def expire_watches(self) -> None:
        """Drop the history and end every live watch with 410 Gone: watchers must list again."""
        self.oldest_kept = self.version + 1
        self.history.clear()
        for queue in self._watchers:
            queue.put_nowait("gone")

    def fail_lists(self, count: int) -> None:
        """The next `count` lists answer 500."""
        self._failing_lists = count

    def _record(self, kind: str, pod: dict) -> None:
        self.version += 1
        stored = copy.deepcopy(pod)
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.history.append((self.version, kind, stored))
        for queue in self._watchers:
            queue.put_nowait((kind, stored))

    # --- the API ------------------------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        namespace = request.match_info.get("namespace")
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") in ("true", "1", "True"):
            return await self._watch(request, namespace, selector)
        self.requests.append("list")
        if self._failing_lists:
            self._failing_lists -= 1
            return web.json_response({"kind": "Status", "code": 500, "message": "etcd is sulking"}, status=500)
        items = [p for (ns, _), p in self.pods.items() if namespace in (None, ns)
                 and _matches(p["metadata"].get("labels", {}), selector)]
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.version)}, "items": items})

    async def _watch(self, request: web.Request, namespace: str | None, selector: str) -> web.StreamResponse:
        since = int(request.query.get("resourceVersion") or self.version)
        self.requests.append(f"watch {since}")
        timeout_s = float(request.query.get("timeoutSeconds", "60"))
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        await out.prepare(request)

        def wanted(pod: dict) -> bool:
            meta = pod["metadata"]
            return namespace in (None, meta["namespace"]) and _matches(meta.get("labels", {}), selector)

        if since < self.oldest_kept - 1:
            await out.write(_line("ERROR", {"kind": "Status", "code": 410, "reason": "Expired",
                                            "message": f"too old resource version: {since}"}))
            return out
        queue: asyncio.Queue = asyncio.Queue()
        self._watchers.add(queue)
        try:
            for version, kind, pod in list(self.history):
                if version > since and wanted(pod):
                    await out.write(_line(kind, pod))
            await self._follow(out, queue, wanted, timeout_s)
        finally:
            self._watchers.discard(queue)
        return out

    async def _follow(self, out: web.StreamResponse, queue: asyncio.Queue, wanted, timeout_s: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            try:
                item = await asyncio.wait_for(queue.get(), left)
            except asyncio.TimeoutError:
                return
            if item is None:
                return
            if item == "gone":
                await out.write(_line("ERROR", {"kind": "Status", "code": 410, "reason": "Expired",
                                                "message": "the watch's resource version was compacted"}))
                return
            kind, pod = item
            if wanted(pod):
                await out.write(_line(kind, pod))


def _line(kind: str, obj: dict) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"
