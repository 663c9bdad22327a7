"""Pinned servers on real processes (tiny model): every thread of every DP worker runs on its share
of `--cpus`, each rank of a TP group on its share of its worker's, and `disagg serve`'s default gives prefill and decode a half of the machine each; a CPU
list this process may not use stops the CLI before anything starts."""

import os
import subprocess
import sys
from dataclasses import replace

import pytest

from cli_process import ROOT
from disagg.cluster import ClusterOptions, drain_cluster, start_cluster
from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.cpus import format_cpu_list, usable_cpus
from disagg.launch import start_server
from pd_cluster import TINY, pd_config

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not {0, 1} <= (usable_cpus() or frozenset()),
                                 reason="needs CPUs 0 and 1 in this process's affinity")]


def thread_affinities(pid: int) -> set[frozenset[int]]:
    """The distinct CPU sets of a process's threads (the main one, the engine thread, torch's team)."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def worker_affinities(server) -> list[set[frozenset[int]]]:
    return [thread_affinities(worker.process.pid) for worker in server.controller.workers]


@pytest.mark.asyncio
async def test_a_unified_server_pinned_to_two_cpus_puts_one_worker_on_each():
    server = await start_server(ServerConfig(port=0, dp_size=2, cpus="0-1"), TINY, DisaggConfig(), lambda _: None)
    try:
        assert worker_affinities(server) == [{frozenset({0})}, {frozenset({1})}]
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_each_rank_of_a_tp_group_runs_on_its_share_of_the_worker_cpus():
    tp2 = replace(TINY, tensor_parallel_size=2)
    server = await start_server(ServerConfig(port=0, dp_size=1, cpus="0-1"), tp2, DisaggConfig(), lambda _: None)
    try:
        rank0 = server.controller.workers[0].process.pid
        with open(f"/proc/{rank0}/task/{rank0}/children") as f:
            [rank1] = [int(p) for p in f.read().split()]
        assert (thread_affinities(rank0), thread_affinities(rank1)) == ({frozenset({0})}, {frozenset({1})})
    finally:
        await server.close()


@pytest.mark.asyncio
async def test_serve_gives_prefill_the_first_cpu_and_decode_the_second(capsys):
    prefill, decode, router = await start_cluster(TINY, pd_config("tcp"), ClusterOptions(port=0, servers=ServerConfig(dp_size=1)))
    try:
        assert (worker_affinities(prefill), worker_affinities(decode)) == ([{frozenset({0})}], [{frozenset({1})}])
        assert ("starting prefill and decode servers (prefill dp 1 + decode dp 1, backend tcp; prefill on CPUs 0, decode on "
                "CPUs 1)") in capsys.readouterr().out.splitlines()
    finally:
        await drain_cluster(prefill, decode, router, 0)


def test_the_cli_refuses_cpus_it_may_not_use():
    usable = format_cpu_list(usable_cpus())
    beyond = max(usable_cpus()) + 1
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-m", "disagg.cli", "unified", "--port", "0", "--cpus", f"0,{beyond}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (2, "")
    assert run.stderr == f"disagg: error: --cpus 0,{beyond}: CPU {beyond} is not usable by this process (it may use {usable})\n"
