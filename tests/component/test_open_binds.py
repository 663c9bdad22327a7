"""The real `disagg` command line refuses a prefill, decode or standalone bootstrap that would bind a
non-loopback address without a cluster secret: exit 2 and the reason, before it binds a port or loads
a model. `--insecure-no-cluster-secret` goes past the check."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from cli_process import ROOT

pytestmark = pytest.mark.timeout(60)
HOW = ("without a cluster secret: anyone who reaches its ports could write bootstrap registry routes, open KV control "
       "streams and read or write KV blocks. Give every prefill, decode and bootstrap of the cluster the same secret "
       "with --cluster-secret or the environment variable DISAGG_CLUSTER_SECRET (not shown by ps), bind loopback "
       "addresses only, or pass --insecure-no-cluster-secret to run the internal planes open, as SGLang and vLLM do")


def disagg(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DISAGG_CLUSTER_SECRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "disagg.cli", *args], capture_output=True, text=True, timeout=50,
                          cwd=ROOT, env=env)


@pytest.fixture
def held_port():
    """A loopback port already taken: a server that got as far as binding it fails with EADDRINUSE."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_prefill_on_0_0_0_0_without_a_secret_is_refused_before_it_binds_or_loads(held_port):
    argv = ["prefill", "--host", "0.0.0.0", "--port", "0", "--bootstrap-port", str(held_port), "--model", "tiny"]
    out = disagg(*argv)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"disagg: error: disagg prefill binds 0.0.0.0 (--host) {HOW}\n")
    # The opt-out passes the check: the prefill goes on to bind its registry (the held port), before any model load.
    out = disagg(*argv, "--insecure-no-cluster-secret")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr.splitlines()[-1] == (f"error: [Errno 98] error while attempting to bind on address "
                                           f"('127.0.0.1', {held_port}): address already in use")


def test_a_decode_and_a_bootstrap_open_to_the_network_are_refused(held_port):
    out = disagg("decode", "--port", "0", "--rank-host", "0.0.0.0", "--model", "/does/not/exist")
    assert (out.returncode, out.stderr) == (2, f"disagg: error: disagg decode binds 0.0.0.0 (--rank-host) {HOW}\n")
    out = disagg("bootstrap", "--host", "0.0.0.0", "--port", str(held_port))
    assert (out.returncode, out.stderr) == (2, f"disagg: error: disagg bootstrap binds 0.0.0.0 (--host) {HOW}\n")
