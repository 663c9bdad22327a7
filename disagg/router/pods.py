"""Pure discovery policy: which servers the router should have, from the pods the Kubernetes API
describes, and what to do to its pool to get there.

No I/O: `pod_view` reads one pod's JSON, `PodTracker` folds list and watch events, and `reconcile`
compares the pods that serve with the pool's members and returns actions (add, drain, readmit).
The watch loop (discovery.py) only feeds events in and applies the actions.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from disagg.router.config import DEFAULT_BOOTSTRAP_PORT
from disagg.router.workers import WorkerInfo

HTTP_PORT_NAME = "http"  # the container port discovery sends requests to
BOOTSTRAP_PORT_NAME = "bootstrap"  # a prefill's bootstrap registry, when no annotation names it


@dataclass(frozen=True)
class PodView:
    """What discovery needs to know of one pod."""

    key: str  # namespace/name
    ip: str | None
    ready: bool
    terminating: bool  # metadata.deletionTimestamp is set
    http_port: int
    bootstrap_port: int | None

    @property
    def serving(self) -> bool:
        """Whether the router should send new requests to it (once its own check succeeds)."""
        return self.ready and not self.terminating and bool(self.ip)

    @property
    def url(self) -> str:
        host = f"[{self.ip}]" if self.ip and ":" in self.ip else self.ip
        return f"http://{host}:{self.http_port}"


def _named_ports(pod: Mapping) -> dict[str, int]:
    ports = {}
    for container in pod.get("spec", {}).get("containers", []) or []:
        for port in container.get("ports", []) or []:
            if port.get("name") and isinstance(port.get("containerPort"), int):
                ports.setdefault(port["name"], port["containerPort"])
    return ports


def _annotated_port(pod: Mapping, annotation: str) -> int | None:
    raw = (pod.get("metadata", {}).get("annotations") or {}).get(annotation)
    try:
        port = int(raw) if raw is not None else None
    except ValueError:
        return None
    return port if port is not None and 1 <= port <= 65535 else None


def pod_view(pod: Mapping, default_port: int, bootstrap_annotation: str) -> PodView:
    """A PodView from the API's JSON for a pod (`items[i]` of a list, `object` of a watch event)."""
    meta = pod.get("metadata", {})
    status = pod.get("status", {}) or {}
    conditions = status.get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    named = _named_ports(pod)
    bootstrap = _annotated_port(pod, bootstrap_annotation) or named.get(BOOTSTRAP_PORT_NAME, DEFAULT_BOOTSTRAP_PORT)
    return PodView(
        key=f"{meta.get('namespace', '')}/{meta.get('name', '')}", ip=status.get("podIP") or None,
        ready=ready and status.get("phase") == "Running", terminating=meta.get("deletionTimestamp") is not None,
        http_port=named.get(HTTP_PORT_NAME, default_port), bootstrap_port=bootstrap,
    )


class EventType(str, enum.Enum):
    """Watch event types (BOOKMARK and ERROR are handled by the watch loop itself)."""

    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


@dataclass(frozen=True)
class Endpoint:
    """A server the router should send requests to."""

    url: str
    bootstrap_port: int | None


class PodTracker:
    """The pods of one role as the API last described them (a list, then watch events).
    `with_bootstrap_port`: prefill pods carry one; decode endpoints have None."""

    def __init__(self, with_bootstrap_port: bool) -> None:
        self._pods: dict[str, PodView] = {}
        self._with_bootstrap_port = with_bootstrap_port

    def replace_all(self, pods: Iterable[PodView]) -> None:
        """A fresh list: pods missing from it are gone."""
        self._pods = {pod.key: pod for pod in pods}

    def apply(self, event: EventType, pod: PodView) -> None:
        """One watch event."""
        if event is EventType.DELETED:
            self._pods.pop(pod.key, None)
        else:
            self._pods[pod.key] = pod

    def wanted(self) -> dict[str, Endpoint]:
        """url -> endpoint of every pod that serves."""
        return {pod.url: Endpoint(pod.url, pod.bootstrap_port if self._with_bootstrap_port else None)
                for pod in self._pods.values() if pod.serving}


class ActionKind(str, enum.Enum):
    ADD = "add"  # a new server: the router checks its /health before it gets requests
    DRAIN = "drain"  # no new requests; those in flight finish, then it is forgotten
    READMIT = "readmit"  # a draining server is wanted again: checked again, then it gets requests


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    url: str
    bootstrap_port: int | None
    worker_id: int | None = None  # None for ADD


def reconcile(wanted: Mapping[str, Endpoint], members: Sequence[WorkerInfo]) -> list[Action]:
    """What to do so that exactly the wanted endpoints admit requests: drains first, then adds.
    `members` are the pool's servers of one role (`WorkerPool.infos`)."""
    actions = []
    admitting = {}
    for m in members:
        if m.admitting and wanted.get(m.url) == Endpoint(m.url, m.bootstrap_port):
            admitting[m.url] = m
        elif m.admitting:
            actions.append(Action(ActionKind.DRAIN, m.url, m.bootstrap_port, m.index))
    for url, endpoint in wanted.items():
        if url in admitting:
            continue
        again = next((m for m in members if not m.admitting and Endpoint(m.url, m.bootstrap_port) == endpoint), None)
        if again is not None:
            actions.append(Action(ActionKind.READMIT, url, endpoint.bootstrap_port, again.index))
        else:
            actions.append(Action(ActionKind.ADD, url, endpoint.bootstrap_port))
    return actions
