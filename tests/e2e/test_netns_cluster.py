"""A P/D pair across real network namespaces: the prefill in one, the decode in another, each binding
its own non-loopback address on a bridge the test makes (veth pairs; removed afterwards), with a
cluster secret; the test drives them from the host side of the bridge. P/D over tcp and nixl answers
as unified does; with the prefill's link cut, a request fails clearly within the decode's deadline
and leaks no block; once the link returns the pair serves again. Skipped, saying why, where network
namespaces cannot be made (not root, no `ip`)."""

import asyncio
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from pd_cluster import TINY, start_unified

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]
ROOT = str(Path(__file__).resolve().parents[2])
BODY = {"text": "The quick brown fox jumps over the lazy dog", "sampling_params": {
    "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def can_make_namespaces() -> str | None:
    """None when this host lets the test make namespaces; else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"dgprobe{os.getpid()}"
    try:
        ip("netns", "add", name)
        ip("netns", "del", name)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"`ip netns add` failed: {getattr(exc, 'stderr', b'').decode().strip() or exc}"
    return None


class Bridge:
    """Namespaces `p` and `d` on a bridge: the host side 10.77.S.254, the prefill .1, the decode .2."""

    def __init__(self):
        tag = f"{os.getpid() % 10000}"
        self.subnet = f"10.77.{os.getpid() % 250}"
        self.bridge, self.ns = f"dgb{tag}", {"p": f"dgp{tag}", "d": f"dgd{tag}"}
        self.host_ends = {n: f"dg{n}h{tag}" for n in self.ns}
        self.addr = {"p": f"{self.subnet}.1", "d": f"{self.subnet}.2"}

    def up(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for n, ns in self.ns.items():
            inner = f"dg{n}n{os.getpid() % 10000}"
            ip("netns", "add", ns)
            ip("link", "add", self.host_ends[n], "type", "veth", "peer", "name", inner)
            ip("link", "set", inner, "netns", ns)
            ip("link", "set", self.host_ends[n], "master", self.bridge)
            ip("link", "set", self.host_ends[n], "up")
            ip("-n", ns, "addr", "add", f"{self.addr[n]}/24", "dev", inner)
            ip("-n", ns, "link", "set", inner, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def link(self, n: str, up: bool) -> None:
        ip("link", "set", self.host_ends[n], "up" if up else "down")

    def down(self) -> None:
        """Remove everything `up` made (a pair goes with either end; a namespace may outlive its name)."""
        for args in (*(("link", "del", end) for end in self.host_ends.values()),
                     *(("netns", "del", ns) for ns in self.ns.values()), ("link", "del", self.bridge)):
            subprocess.run(["ip", *args], capture_output=True, timeout=10)


async def start_in(ns: str, *args: str, secret: str) -> tuple[asyncio.subprocess.Process, str]:
    """`disagg ARGS` inside namespace `ns`; (the process, its ready line)."""
    env = dict(os.environ, PYTHONPATH=ROOT, DISAGG_CLUSTER_SECRET=secret)
    proc = await asyncio.create_subprocess_exec("ip", "netns", "exec", ns, sys.executable, "-m", "disagg.cli", *args,
                                                cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
    lines = []
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
        if not line:
            raise AssertionError(f"disagg {' '.join(args)} in {ns} exited:\n{''.join(lines)}")
        lines.append(line)
        if "ready: " in line:  # a worker's log line may lack its newline when the ready line comes
            asyncio.get_running_loop().create_task(drain(proc.stdout))
            return proc, line[line.index("ready: "):]


async def drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except asyncio.TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


def field(ready: str, name: str) -> str:
    return next(part.split("=", 1)[1].rstrip(";") for part in ready.split() if part.startswith(name + "="))


async def free_blocks(session: aiohttp.ClientSession, url: str) -> float:
    """The decode's free KV blocks now (/metrics asks the workers at the scrape)."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("disagg_num_free_blocks{"))


async def back_to(session: aiohttp.ClientSession, url: str, baseline: float, within_s: float) -> float:
    """The free blocks once they are `baseline` again (a failed room's blocks stay quarantined until
    its prefill is declared lost), or what they are at the deadline."""
    for _ in range(int(within_s / 0.25)):
        if (free := await free_blocks(session, url)) == baseline:
            return free
        await asyncio.sleep(0.25)
    return await free_blocks(session, url)


@pytest.fixture
def bridge():
    why = can_make_namespaces()
    if why is not None:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    b = Bridge()
    try:
        b.up()
        yield b
    finally:
        b.down()


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
async def test_pd_across_namespaces_equals_unified_and_survives_a_cut_link(bridge, backend):
    secret = secrets.token_hex(16)
    p, d = bridge.addr["p"], bridge.addr["d"]
    prefill, ready_p = await start_in(bridge.ns["p"], "prefill", "--model", "tiny", "--host", p, "--port", "0",
                                      "--rank-host", p, "--bootstrap-host", p, "--bootstrap-port", "0",
                                      "--transfer-backend", backend, "--bootstrap-timeout-s", "3", secret=secret)
    decode = None
    unified = await start_unified(TINY)
    try:
        decode, ready_d = await start_in(bridge.ns["d"], "decode", "--model", "tiny", "--host", d, "--port", "0",
                                         "--rank-host", d, "--transfer-backend", backend, "--waiting-timeout-s", "4",
                                         "--connect-timeout-s", "2", "--abort-ack-timeout-s", "2", secret=secret)
        prefill_url, decode_url = ready_p.split()[1], ready_d.split()[1]
        assert prefill_url.startswith(f"http://{p}:") and decode_url.startswith(f"http://{d}:")
        bootstrap = {"bootstrap_host": p, "bootstrap_port": int(field(ready_p, "bootstrap_port"))}
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{unified.port}/generate", json=BODY) as r:
                want = (await r.json())["output_ids"]

            async def both(room: int) -> tuple[tuple[int, dict], tuple[int, dict]]:
                body = {**BODY, **bootstrap, "bootstrap_room": room}
                async def post(url):
                    async with session.post(url + "/generate", json=body) as r:
                        return r.status, await r.json()
                return await asyncio.gather(post(prefill_url), post(decode_url))

            (p_status, _), (d_status, answer) = await both(secrets.randbits(62))
            assert (p_status, d_status, answer["output_ids"]) == (200, 200, want)
            baseline = await free_blocks(session, decode_url)  # the first answer's blocks stay cached
            bridge.link("p", up=False)  # the prefill is gone from the network
            body = {**BODY, **bootstrap, "bootstrap_room": secrets.randbits(62)}
            async with session.post(decode_url + "/generate", json=body) as r:
                status, failed = r.status, await r.json()
            assert status in (500, 503, 504) and failed["error"]["message"], failed
            assert await back_to(session, decode_url, baseline, 20) == baseline  # nothing leaked on the decode
            bridge.link("p", up=True)
            for _ in range(30):  # the decode reconnects on its next request
                (p_status, _), (d_status, answer) = await both(secrets.randbits(62))
                if (p_status, d_status) == (200, 200):
                    break
                await asyncio.sleep(0.5)
            assert (p_status, d_status, answer["output_ids"]) == (200, 200, want)
            assert await back_to(session, decode_url, baseline, 20) == baseline
    finally:
        await unified.close()
        for proc in (decode, prefill):
            if proc is not None:
                await stop(proc)
