"""A real router (sglang-router, vllm-router) as a subprocess on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
from pathlib import Path

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def router_process(args: list[str], log_dir: Path, name: str):
    """Run `args + --host 127.0.0.1 --port P --prometheus-port Q` until its /health answers 200
    (bounded); yields its URL; terminates it on the way out."""
    port = free_port()
    cmd = args + ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    with open(log_dir / "router.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as s:
                for _ in range(120):
                    try:
                        async with s.get(url + "/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    assert proc.poll() is None, f"{name} exited with {proc.returncode}"
                    await asyncio.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            proc.wait(10)
