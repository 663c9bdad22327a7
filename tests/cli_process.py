"""`disagg ARGS` from this checkout as a subprocess, read up to its ready line: the start-up that
every test of whole processes shares."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


async def start_cli(*args: str, timeout_s: float = 90.0, stderr=asyncio.subprocess.DEVNULL,
                    env: dict[str, str] | None = None, new_session: bool = False) -> tuple[asyncio.subprocess.Process, list[str]]:
    """(the process, its stdout lines up to and including `ready: URL ...`). A process that exits or
    stays silent past `timeout_s` before that line is killed and fails the test with what it printed.
    `new_session`: the process leads a process group of its own (its workers join it)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "disagg.cli", *args, cwd=ROOT, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=stderr,
                                                start_new_session=new_session)
    lines: list[str] = []
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while not (lines and lines[-1].startswith("ready:")):
            left = deadline - asyncio.get_running_loop().time()
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), max(left, 0.001))).decode()
            except TimeoutError:
                raise AssertionError(f"disagg {' '.join(args)} printed no ready line in {timeout_s} s:\n{''.join(lines)}") from None
            if not line:
                raise AssertionError(f"disagg {' '.join(args)} exited before its ready line:\n{''.join(lines)}")
            at = line.find("ready: ")
            if at > 0:  # a worker's log line, written to the same stdout, lacked its newline when the ready line came
                lines.append(line[:at] + "\n")
                line = line[at:]
            lines.append(line)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    return proc, lines


def ready_url(lines: list[str]) -> str:
    """The URL of the ready line (`ready: URL ...`)."""
    return lines[-1].split()[1]
