"""Pick a backend by name: create_backend('nixl' | 'tcp' | 'loopback', ...), available_backends()."""

from __future__ import annotations

from disagg.pd_config import TcpListenerConfig
from kvtransfer.base import BackendUnavailable, KVTransferBackend
from kvtransfer.loopback import LoopbackBackend, LoopbackFabric
from kvtransfer.nixl import NixlBackend, nixl_installed
from kvtransfer.tcp.backend import TcpBackend

BACKEND_NAMES = ("nixl", "tcp", "loopback")


def available_backends() -> list[str]:
    """Backends that can start in this environment, best first (NIXL is checked without importing it)."""
    return [name for name in BACKEND_NAMES if name != "nixl" or nixl_installed()]


def create_backend(
    name: str, *, agent_name: str | None = None, host: str = "127.0.0.1", num_threads: int = 0,
    fabric: LoopbackFabric | None = None, cluster_secret: str | None = None,
    tcp_listener: TcpListenerConfig = TcpListenerConfig(),
) -> KVTransferBackend:
    """A new, unregistered backend. `host` is where tcp listens; `num_threads` feeds NIXL's UCX
    backend; `fabric` joins loopback endpoints of one process; `cluster_secret` makes tcp challenge
    every inbound peer and answer its peers' challenges (NIXL moves bytes over UCX, which cannot be
    authenticated: its metadata crosses the secret-guarded control stream instead); `tcp_listener`
    bounds tcp's connections before they pass that challenge. Raises BackendUnavailable naming the
    available backends."""
    if name == "nixl":
        return NixlBackend(agent_name, num_threads=num_threads)
    if name == "tcp":
        return TcpBackend(agent_name, host=host, cluster_secret=cluster_secret, listener=tcp_listener)
    if name == "loopback":
        return LoopbackBackend(fabric, agent_name)
    raise BackendUnavailable(f"unknown transfer backend {name!r}; available backends: {', '.join(available_backends())}")
