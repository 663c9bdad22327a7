"""The import rule (docs/architecture.md, "Floors and the import rule"), enforced by walking every module's AST."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("disagg", "prefill", "decode", "bootstrap", "kvtransfer")

# Most specific prefix wins.
LAYERS = {
    "disagg.cli": 4, "disagg.launch": 4, "disagg.cluster": 4, "disagg.testing": 4,
    "prefill": 3, "decode": 3, "disagg.dp": 3, "disagg.worker": 3, "disagg.worker.roles": 3, "disagg.api": 3, "disagg.router": 3,
    "bootstrap.server": 3, "disagg.bench": 3, "disagg.top": 3,
    "disagg.engine": 2, "kvtransfer": 2, "bootstrap.client": 2, "bootstrap.registry": 2,
    "disagg.ops": 1,
    "disagg.config": 0, "disagg.tracing": 0, "disagg.pd_config": 0, "disagg.registry_config": 0, "disagg.host_patterns": 0, "disagg.engine_config": 0, "disagg.types": 0, "disagg.wire": 0, "disagg": 0, "bootstrap": 2,
    "disagg.http_site": 0, "disagg.kv_events_config": 0, "disagg.tool_config": 0, "disagg.cpus": 0, "disagg.block_hashes": 0, "disagg.rank_rule": 0,
}
# Same-layer edges that are allowed: the P/D roles build on the worker's unified role; the front's
# controller starts workers (their spec, the role factories); the factories import the three roles
# (in the worker); the HTTP site reads its TLS options (and raises ConfigError) from config.
SAME_LAYER_OK = {
    ("prefill", "disagg.worker"), ("decode", "disagg.worker"), ("disagg.dp", "disagg.worker"),
    ("disagg.dp", "disagg.worker.roles"), ("disagg.worker.roles", "disagg.worker"),
    ("disagg.worker.roles", "prefill"), ("disagg.worker.roles", "decode"),
    ("disagg.worker", "disagg.worker.roles"),  # the worker's spec names RoleSpec's type (TYPE_CHECKING only)
    ("disagg.api", "disagg.dp"), ("disagg.rank_rule", "disagg.config"), ("disagg.rank_rule", "disagg.types"), ("disagg.wire", "disagg.types"), ("disagg.engine_config", "disagg.config"), ("disagg.registry_config", "disagg.config"), ("disagg.kv_events_config", "disagg.config"), ("disagg.cpus", "disagg.config"), ("disagg.config", "disagg.host_patterns"), ("disagg.pd_config", "disagg.config"), ("disagg.pd_config", "disagg.host_patterns"), ("disagg.config", "disagg.tool_config"), ("disagg.http_site", "disagg.config"), ("disagg.bench", "disagg.router"), ("disagg.cli", "disagg.launch"), ("disagg.cli", "disagg.cluster"), ("disagg.cluster", "disagg.launch"),
    ("disagg.testing", "disagg.launch"), ("disagg", "disagg.types"),  # http_edge's error codes
    ("disagg.tracing", "disagg.config"),  # ConfigError when the tracing extra is missing
}
NETWORK_LIBS = {"aiohttp", "grpc", "socket", "asyncio", "nixl", "nixl_cu12", "nixl_cu13", "ucxx", "requests", "zmq"}
NO_TORCH = ("disagg.api", "disagg.router", "disagg.top", "bootstrap", "disagg.config", "disagg.pd_config", "disagg.tool_config", "disagg.cpus", "disagg.block_hashes", "disagg.kv_events_config", "disagg.registry_config", "disagg.host_patterns", "disagg.engine_config",
            "disagg.types", "disagg.wire", "disagg.tracing")
# The P/D control plane (rooms, leases, request ids) builds on the transfer backends, never the other
# way round: every other kvtransfer module stays request-agnostic and imports neither it nor its wire.
CONTROL = "kvtransfer.control"
CONTROL_WIRE = ("disagg.wire.control_msgs", "disagg.wire.kv_control_pb2", "disagg.wire.kv_control_pb2_grpc")
# What the control plane may take from the rest of kvtransfer: the backends' base (Protocol, states,
# errors), the layout's heads and the check of two layouts (heads), the factory that picks one by name
# and the heartbeat switch of fault injection; never one backend's internals.
CONTROL_BUILDS_ON = ("kvtransfer", "kvtransfer.base", "kvtransfer.heads", "kvtransfer.factory", "kvtransfer.faulty")


def unit_of(module: str) -> str:
    best = ""
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return best


def modules() -> list[tuple[str, pathlib.Path]]:
    found = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            found.append((".".join(parts), path))
    return found


def is_module(name: str) -> bool:
    """True when `name` is one of our modules or packages (not a name imported from one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports_of(module: str, path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append(target)
            out += [f"{target}.{alias.name}" for alias in node.names]
    return out


def violations(extra: list[tuple[str, pathlib.Path]] = ()) -> list[str]:
    bad = []
    for module, path in modules() + list(extra):
        src = unit_of(module)
        for target in imports_of(module, path):
            top = target.split(".")[0]
            if src.startswith("disagg.engine") and top in NETWORK_LIBS | {"kvtransfer", "bootstrap", "prefill", "decode"}:
                bad.append(f"{module} imports {target}: the engine stays free of network and roles")
            if src == "kvtransfer" and target.startswith("disagg.engine"):
                bad.append(f"{module} imports {target}: kvtransfer never imports the engine")
            if src == "kvtransfer" and not within(module, CONTROL) and (
                    target in CONTROL_WIRE or (within(target, CONTROL) and is_module(target))):
                bad.append(f"{module} imports {target}: the backends stay request-agnostic (rooms live in {CONTROL})")
            if (within(module, CONTROL) and within(target, "kvtransfer") and not within(target, CONTROL)
                    and is_module(target) and target not in CONTROL_BUILDS_ON):
                bad.append(f"{module} imports {target}: {CONTROL} builds on the backends' base, never on one backend")
            if {src, top} == {"prefill", "decode"}:
                bad.append(f"{module} imports {target}: prefill and decode never import each other")
            if any(src == p or src.startswith(p + ".") for p in NO_TORCH) and top == "torch":
                bad.append(f"{module} imports torch: the front door stays torch-free")
            if top not in PACKAGES:
                continue
            dst = unit_of(target)
            if not dst or dst == src or dst == "disagg" and target == "disagg":
                continue
            if LAYERS[dst] > LAYERS[src] or (LAYERS[dst] == LAYERS[src] and (src, dst) not in SAME_LAYER_OK):
                bad.append(f"{module} (L{LAYERS[src]}) imports {target} (L{LAYERS[dst]})")
    return bad


def test_imports_point_down():
    assert violations() == []


def test_rule_catches_bad_imports(tmp_path):
    """The checker itself must fail on known-bad modules, or the test above proves nothing."""
    ops = tmp_path / "ops_probe.py"
    ops.write_text("import disagg.engine\n")
    router = tmp_path / "router_probe.py"
    router.write_text("import torch\nfrom prefill import role\n")
    engine = tmp_path / "engine_probe.py"
    engine.write_text("import aiohttp\n")
    backend = tmp_path / "backend_probe.py"
    backend.write_text("from kvtransfer.control.server import ControlServer\nfrom disagg.wire.control_msgs import PeerMsg\n")
    control = tmp_path / "control_probe.py"
    control.write_text("from kvtransfer.base import KVLayout\nfrom kvtransfer.factory import create_backend\n"
                       "from kvtransfer.tcp.backend import TcpBackend\n")
    found = violations([("disagg.ops.probe", ops), ("disagg.router.probe", router), ("disagg.engine.probe", engine),
                        ("kvtransfer.tcp.probe", backend), ("kvtransfer.control.probe", control)])
    assert found == [
        "disagg.ops.probe (L1) imports disagg.engine (L2)",
        "disagg.router.probe imports torch: the front door stays torch-free",
        "disagg.router.probe (L3) imports prefill (L3)",
        "disagg.router.probe (L3) imports prefill.role (L3)",
        "disagg.engine.probe imports aiohttp: the engine stays free of network and roles",
        "kvtransfer.tcp.probe imports kvtransfer.control.server: the backends stay request-agnostic (rooms live in kvtransfer.control)",
        "kvtransfer.tcp.probe imports disagg.wire.control_msgs: the backends stay request-agnostic (rooms live in kvtransfer.control)",
        "kvtransfer.control.probe imports kvtransfer.tcp.backend: kvtransfer.control builds on the backends' base, never on one backend",
    ]


def test_front_door_imports_without_torch():
    code = (
        "import sys, importlib, pkgutil\n"
        "for name in ['disagg', 'disagg.config', 'disagg.engine_config', 'disagg.types', 'bootstrap', 'disagg.router', 'disagg.api']:\n"
        "    try: importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name != name: raise\n"
        "import disagg.router.app, disagg.router.launch\n"
        "print('torch' in sys.modules, 'kubernetes_asyncio' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False False"  # discovery's client loads only with --service-discovery
