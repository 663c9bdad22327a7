"""The real sglang-router (push) or vllm-router (pull) as a subprocess in front of a Cluster(router=False)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

PROTOCOL = {"sglang": "push", "vllm": "pull"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_args(kind: str, cluster) -> list[str]:
    if kind == "sglang":
        return [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", cluster.prefill.url, str(cluster.prefill.bootstrap_port), "--decode", cluster.decode.url]
    return [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
            "--prefill", cluster.prefill.url, "--decode", cluster.decode.url]


@contextlib.contextmanager
def real_router(kind: str, cluster, log_dir: Path) -> Iterator[str]:
    """Its URL once /health answers 200 (bounded); terminated on the way out."""
    port = free_port()
    args = router_args(kind, cluster) + ["--host", "127.0.0.1", "--port", str(port),
                                         "--prometheus-port", str(free_port())]
    with open(log_dir / f"{kind}-router.log", "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, f"{kind}-router exited with {proc.returncode}"
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
                assert time.monotonic() < deadline, f"{kind}-router not healthy in 60 s"
                time.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)
