"""`NetnsCluster`: our router, a standalone bootstrap registry, a prefill and a decode server, each in
a network namespace of its own, for tests of what a real network does to P/D. Linux and root only:
the namespaces hang on a bridge this makes (one veth pair each) and removes on stop. Each process binds
its own address on the bridge (never loopback), with a cluster secret and, given certificates, HTTPS
on the router and both servers. The caller, on the host side of the bridge, may cut a namespace's link
(`link`) and shape what it sends (`shape`: tc's tbf for a slow link, netem for delay and loss where
the kernel has it). The processes are what `disagg bootstrap|prefill|decode|router` run.
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from disagg.testing.cluster import Metrics, wait_no_leaks
from disagg.testing.faults import Faults
from disagg.testing.http import post

NAMES = ("router", "registry", "prefill", "decode")
_counter = itertools.count()


class QdiscUnavailable(RuntimeError):
    """The kernel refused a qdisc (e.g. no sch_netem): tc's own words."""


def namespaces_unavailable() -> str | None:
    """None when this host lets us make network namespaces; else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"dgprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", name], capture_output=True, timeout=10)
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return None


def qdisc_unavailable(*qdisc: str) -> str | None:
    """None when the kernel has `qdisc` (tried on a namespace of its own, removed after); else tc's words."""
    probe = Namespaces(("probe",))
    try:
        probe.up()
        probe.shape("probe", *qdisc)
        return None
    except QdiscUnavailable as exc:
        return str(exc)
    finally:
        probe.down()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


class Namespaces:
    """One namespace per name on a bridge: the host side `host_address` (.254), name i at `.i+1`."""

    def __init__(self, names: tuple[str, ...] = NAMES):
        tag = f"{os.getpid() % 1000}{next(_counter) % 10}"
        self.subnet = f"10.{78 + next(_counter) % 100}.{os.getpid() % 250}"
        self.bridge = f"dgb{tag}"
        self.ns = {n: f"dg{i}n{tag}" for i, n in enumerate(names)}
        self.host_ends = {n: f"dg{i}h{tag}" for i, n in enumerate(names)}
        self.inner = {n: f"dg{i}i{tag}" for i, n in enumerate(names)}
        self.address = {n: f"{self.subnet}.{i + 1}" for i, n in enumerate(names)}
        self.host_address = f"{self.subnet}.254"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.host_address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for n, ns in self.ns.items():
            _ip("netns", "add", ns)
            _ip("link", "add", self.host_ends[n], "type", "veth", "peer", "name", self.inner[n])
            _ip("link", "set", self.inner[n], "netns", ns)
            _ip("link", "set", self.host_ends[n], "master", self.bridge)
            _ip("link", "set", self.host_ends[n], "up")
            _ip("-n", ns, "addr", "add", f"{self.address[n]}/24", "dev", self.inner[n])
            _ip("-n", ns, "link", "set", self.inner[n], "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Remove everything `up` made (a veth pair goes with either end)."""
        for args in (*(("link", "del", end) for end in self.host_ends.values()),
                     *(("netns", "del", ns) for ns in self.ns.values()), ("link", "del", self.bridge)):
            subprocess.run(["ip", *args], capture_output=True, timeout=10)

    def link(self, name: str, up: bool) -> None:
        """Cut (or restore) `name`'s link to the bridge: its packets go nowhere, its peers' reach it not."""
        _ip("link", "set", self.host_ends[name], "up" if up else "down")

    def shape(self, name: str, *qdisc: str) -> None:
        """What `name` sends passes `tc qdisc ... root QDISC` (e.g. `tbf rate 1mbit burst 16kb latency
        1s`, `netem delay 20ms loss 1%`); QdiscUnavailable when the kernel has no such qdisc."""
        done = subprocess.run(["ip", "netns", "exec", self.ns[name], "tc", "qdisc", "replace", "dev", self.inner[name],
                               "root", *qdisc], capture_output=True, timeout=10)
        if done.returncode != 0:
            raise QdiscUnavailable(f"tc qdisc {' '.join(qdisc)}: {done.stderr.decode().strip()}")

    def unshape(self, name: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.ns[name], "tc", "qdisc", "del", "dev", self.inner[name], "root"],
                       capture_output=True, timeout=10)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for HTTPS: a CA, and a certificate (with its key) that names every namespace's address."""

    ca: str
    certfile: str
    keyfile: str


class RemoteServer:
    """A prefill or decode server in its namespace: `url` (reached from the host), `metrics()`, `faults`."""

    def __init__(self, role: str, url: str, context: ssl.SSLContext | None):
        self.role, self.url, self._context = role, url, context
        self.faults = Faults(url, context=context)

    def metrics(self) -> Metrics:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10, context=self._context) as resp:
            return Metrics(resp.read().decode())


class NetnsCluster:
    """Start with `with NetnsCluster(...) as cluster:` (or start()/stop()). `backend` (tcp or nixl),
    `tls` (TlsFiles whose certificate names each role's address: read `addresses` first, then set
    `cluster.tls` before start), `fault_injection`, extra CLI arguments per process (`args={"decode":
    [...], "router": [...]}`) and environment (`env`: e.g. `UCX_TLS=tcp`, so that nixl's KV crosses the
    bridge as between hosts, not the shared memory UCX picks on one host). Reads: `router_url`,
    `prefill`, `decode` (RemoteServer), `registry_url`, `net` (link and shape), `ssl_context` (trusting
    the CA), `post()`, `reference()` (a unified server on the host), `assert_no_leaks()`."""

    def __init__(self, model: str = "tiny", *, backend: str = "tcp", tls: TlsFiles | None = None,
                 fault_injection: bool = False, args: dict[str, list[str]] | None = None,
                 env: dict[str, str] | None = None, start_timeout_s: float = 120.0):
        self.model, self.backend, self.tls = model, backend, tls
        self.fault_injection, self.args, self.start_timeout_s = fault_injection, args or {}, start_timeout_s
        self.env = env or {}
        self.net = Namespaces()
        self.secret = secrets.token_hex(16)
        self.ssl_context: ssl.SSLContext | None = None  # set at start from `tls`
        self.logs = Path(tempfile.mkdtemp(prefix="disagg-netns-"))
        self._procs: dict[str, subprocess.Popen] = {}
        self.router_url = self.registry_url = ""
        self.prefill = self.decode = None
        self._reference_url: str | None = None

    @property
    def addresses(self) -> dict[str, str]:
        """Each role's address (known before start: certificates must name them)."""
        return dict(self.net.address)

    # ---- life ---------------------------------------------------------------------------------

    def start(self) -> NetnsCluster:
        why = namespaces_unavailable()
        if why is not None:
            raise RuntimeError(f"network namespaces cannot be made here: {why}")
        self.ssl_context = None if self.tls is None else ssl.create_default_context(cafile=self.tls.ca)
        try:
            self.net.up()
            self._start_all()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_all(self) -> None:
        a, scheme = self.net.address, "http" if self.tls is None else "https"
        tls = [] if self.tls is None else ["--ssl-certfile", self.tls.certfile, "--ssl-keyfile", self.tls.keyfile]
        faults = ["--enable-fault-injection"] if self.fault_injection else []
        self.registry_url = self._run("registry", ["bootstrap", "--host", a["registry"], "--port", "0"])
        registry_port = self.registry_url.rsplit(":", 1)[1]
        common = ["--model", self.model, "--port", "0", "--transfer-backend", self.backend, *tls, *faults]
        self._spawn("prefill", ["prefill", *common, "--host", a["prefill"], "--rank-host", a["prefill"],
                                "--external-registry", "--bootstrap-host", a["registry"], "--bootstrap-port", registry_port])
        self._spawn("decode", ["decode", *common, "--host", a["decode"], "--rank-host", a["decode"]])
        prefill_url, decode_url = self._ready("prefill"), self._ready("decode")
        assert prefill_url.startswith(f"{scheme}://{a['prefill']}:") and decode_url.startswith(f"{scheme}://{a['decode']}:")
        self.prefill = RemoteServer("prefill", prefill_url, self.ssl_context)
        self.decode = RemoteServer("decode", decode_url, self.ssl_context)
        upstream = [] if self.tls is None else ["--upstream-ca-certs", self.tls.ca]
        self.router_url = self._run("router", ["router", "--host", a["router"], "--port", "0", "--prefill", prefill_url,
                                               f"{a['registry']}:{registry_port}", "--decode", decode_url,
                                               "--health-check-interval-s", "1", *upstream, *tls])

    def _spawn(self, name: str, argv: list[str]) -> None:
        """`disagg ARGV` in `name`'s namespace (on the host when it has none), its output in `logs`."""
        env = dict(os.environ, **self.env, DISAGG_CLUSTER_SECRET=self.secret, PYTHONUNBUFFERED="1")
        where = ["ip", "netns", "exec", self.net.ns[name]] if name in self.net.ns else []
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own copy
            self._procs[name] = subprocess.Popen(
                [*where, sys.executable, "-m", "disagg.cli", *argv, *self.args.get(name, [])], stdout=log,
                stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def _ready(self, name: str) -> str:
        """The URL of `name`'s ready line, once printed (its log's tail when it exits or times out)."""
        deadline, path = time.monotonic() + self.start_timeout_s, self.logs / f"{name}.log"
        while time.monotonic() < deadline:
            text = path.read_text(errors="replace")
            if "ready: " in text:
                return text[text.index("ready: ") + 7:].split()[0]
            if self._procs[name].poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not start:\n{path.read_text(errors='replace')[-3000:]}")

    def _run(self, name: str, argv: list[str]) -> str:
        self._spawn(name, argv)
        return self._ready(name)

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after 30 s), then remove the namespaces."""
        for proc in self._procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self._procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        self.net.down()

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ---- what a test uses ---------------------------------------------------------------------

    def post(self, path: str, body: dict, timeout_s: float = 120.0) -> tuple[int, object]:
        """POST `body` to our router (from the host side of the bridge)."""
        return post(self.router_url + path, body, timeout_s=timeout_s, context=self.ssl_context)

    def reference(self, path: str, body: dict) -> object:
        """What a unified server of the same model answers (on the host's loopback; started on first use)."""
        if self._reference_url is None:
            self._reference_url = self._run("unified", ["unified", "--model", self.model, "--port", "0"])
        return post(self._reference_url + path, body)[1]

    def assert_no_leaks(self, timeout_s: float = 10.0) -> None:
        """Within `timeout_s`, every worker of both servers back to where it started (Cluster's check)."""
        wait_no_leaks((self.prefill, self.decode), timeout_s)
