"""disagg.testing.Cluster and every fault, observed with exact values through our router (no retries,
2 s bootstrap and KV deadlines, heartbeats every 0.2 s), each followed by `assert_no_leaks()`."""

import asyncio
import os
import re
import time

import pytest

from disagg.pd_config import ControlConfig
from disagg.testing import Cluster, FaultRefused
from disagg.testing.http import post

pytestmark = pytest.mark.timeout(180)
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster():
    with Cluster(fault_injection=True, router_options={"retry_max_retries": 0},
                 disagg={"waiting_timeout_s": 2, "bootstrap_timeout_s": 2,
                         "control": ControlConfig(heartbeat_interval_s=0.2, heartbeat_max_misses=3)}) as c:
        yield c


def ask(cluster, body=BODY):
    """(status, body, seconds) of a completion through the router."""
    start = time.monotonic()
    status, answer = post(cluster.router_url + "/v1/completions", body)
    return status, answer, time.monotonic() - start


def faults_counted(server) -> dict[tuple[str, str], float]:
    return {(ls["fault"], ls["dp_rank"]): v for n, ls, v in server.metrics().samples if n == "disagg_faults_injected_total"}


def test_a_cluster_starts_answers_like_unified_and_stops_every_process():
    with Cluster(prefill_dp=2, decode_dp=1) as c:
        status, answer = post(c.router_url + "/v1/completions", BODY)
        assert status == 200
        assert answer["choices"][0]["text"] == c.reference("/v1/completions", BODY)["choices"][0]["text"]
        assert [w.rank for w in c.prefill.workers()] == [0, 1] and c.decode.workers()[0].alive
        assert c.prefill.bootstrap_port is not None and c.decode.bootstrap_port is None
        c.assert_no_leaks()
        pids = c.pids()
        assert len(pids) == 4  # two prefill workers, one decode worker, the reference server's worker
    assert [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []


def test_failed_requests_answer_the_injected_status(cluster):
    assert cluster.decode.faults.fail_requests(rank=0, count=1, status=500) == {
        "fault": "fail_requests", "dp_rank": 0, "count": 1, "status": 500}
    status, answer, _ = ask(cluster)
    assert (status, answer["error"]["message"]) == (500, "injected fault: DP worker 0 answers 500")
    cluster.prefill.faults.fail_requests(rank=0, count=1, status=429)
    status, answer, _ = ask(cluster)
    assert (status, answer["error"]["message"]) == (429, "injected fault: DP worker 0 answers 429")
    assert ask(cluster)[0] == 200  # one request each: the next is served
    assert faults_counted(cluster.decode)[("fail_requests", "0")] == 1
    cluster.assert_no_leaks()


def test_a_failed_transfer_fails_its_request_and_frees_every_block(cluster):
    cluster.prefill.faults.fail_transfers(rank=0, count=1)
    status, answer, _ = ask(cluster)
    assert (status, answer["error"]["message"]) == (500, "KV transfer failed: injected fault: transfer failed")
    cluster.assert_no_leaks()
    assert ask(cluster)[0] == 200


def test_a_delayed_transfer_holds_its_request_and_is_measured(cluster):
    before = cluster.prefill.metrics().value("disagg_kv_transfer_seconds_sum")
    cluster.prefill.faults.delay_transfers(rank=0, count=1, seconds=1.5)
    status, answer, seconds = ask(cluster)
    assert status == 200 and seconds >= 1.5
    assert answer["choices"][0]["text"] == cluster.reference("/v1/completions", BODY)["choices"][0]["text"]
    assert cluster.prefill.metrics().value("disagg_kv_transfer_seconds_sum") - before >= 1.5
    cluster.assert_no_leaks()


def test_slow_steps_slow_every_token(cluster):
    cluster.decode.faults.slow_steps(rank=0, ms=200)
    status, _, seconds = ask(cluster)
    cluster.decode.faults.slow_steps(rank=0, ms=0)
    assert status == 200 and seconds >= 7 * 0.2  # 8 tokens: the first comes from the prefill
    assert faults_counted(cluster.decode)[("slow_steps", "0")] == 2


def test_a_stalled_prefill_is_found_out_by_its_missing_heartbeats(cluster):
    cluster.prefill.faults.stall(rank=0, seconds=4)
    status, answer, seconds = ask(cluster)
    assert status == 503  # 3 heartbeats of 0.2 s missed: before the 2 s KV deadline, long before the stall ends
    assert re.fullmatch(r"lost connection to prefill 127\.0\.0\.1:\d+: 3 heartbeats missed", answer["error"]["message"])
    assert seconds < 4
    time.sleep(4 - seconds)
    cluster.assert_no_leaks(timeout_s=15)
    assert ask(cluster)[0] == 200


def test_a_stalled_decode_fails_the_request_at_the_prefills_bootstrap_deadline(cluster):
    cluster.decode.faults.stall(rank=0, seconds=4)
    status, answer, seconds = ask(cluster)
    assert status == 500 and 2 <= seconds < 4  # the prefill's bootstrap deadline, before the stall ends
    assert re.fullmatch(r"no destination from decode for bootstrap_room \d+ within 2 s", answer["error"]["message"])
    time.sleep(4 - seconds)
    cluster.assert_no_leaks(timeout_s=15)


def test_silent_heartbeats_cut_the_control_stream_until_they_resume(cluster):
    cluster.prefill.faults.stop_heartbeats(rank=0, seconds=3)
    cluster.prefill.faults.slow_steps(rank=0, ms=1500)  # the request outlives 3 missed heartbeats (0.6 s)
    status, answer, seconds = ask(cluster)
    cluster.prefill.faults.slow_steps(rank=0, ms=0)
    assert (status, seconds < 2) == (503, True)  # found out before the 2 s KV deadline
    assert re.fullmatch(r"lost connection to prefill 127\.0\.0\.1:\d+: 3 heartbeats missed", answer["error"]["message"])
    time.sleep(3)
    assert ask(cluster)[0] == 200
    cluster.assert_no_leaks()


def test_a_killed_worker_is_restarted_and_counted(cluster):
    old = cluster.decode.workers()[0].pid
    cluster.decode.faults.kill(rank=0)
    deadline = time.monotonic() + 60
    while not (cluster.decode.workers()[0].restarts == 1 and cluster.decode.workers()[0].ready):
        assert time.monotonic() < deadline, cluster.decode.workers()
        time.sleep(0.1)
    assert cluster.decode.workers()[0].pid != old and not os.path.exists(f"/proc/{old}")
    deadline = time.monotonic() + 20
    while (answer := ask(cluster))[0] != 200:  # until the router's next health check (every 1 s) sees it back
        assert (answer[0], answer[1]["error"]["message"]) == (503, "no healthy decode server")
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert cluster.decode.metrics().by_rank("disagg_worker_restarts") == {0: 1.0}
    cluster.assert_no_leaks()


def test_faults_are_checked_and_only_on_servers_that_allow_them(cluster):
    with pytest.raises(FaultRefused) as refused:
        cluster.decode.faults.inject("melt", 0)
    assert (refused.value.status, refused.value.message) == (
        400, "unknown fault 'melt': one of stall, kill, fail_requests, slow_steps, delay_transfers, fail_transfers, "
             "corrupt_transfers, stop_heartbeats")
    with pytest.raises(FaultRefused) as refused:
        cluster.decode.faults.fail_requests(rank=0, count=0)
    assert refused.value.message == "fail_requests needs count: an integer in [1, 1000000], got 0"
    with pytest.raises(FaultRefused) as refused:
        cluster.decode.faults.fail_requests(rank=0, status=418)
    assert refused.value.message == "fail_requests needs status: one of 400, 404, 413, 429, 500, 503, got 418"
    with pytest.raises(FaultRefused) as refused:
        cluster.decode.faults.kill(rank=3)
    assert (refused.value.status, refused.value.message) == (400, "DP rank 3 is not active (dp_size=1)")


def test_fault_routes_need_the_flag_and_the_admin_key():
    with Cluster(router=False, fault_injection=True, admin_key="k" * 32) as c:
        with pytest.raises(FaultRefused) as refused:
            type(c.decode.faults)(c.decode.url).stall(0, 1)
        assert refused.value.status == 401
        assert c.decode.faults.slow_steps(0, 0)["fault"] == "slow_steps"
    with Cluster(router=False) as c:
        with pytest.raises(FaultRefused) as refused:
            c.decode.faults.stall(0, 1)
        assert refused.value.status == 404


async def test_the_async_form_starts_and_stops_off_the_tests_loop():
    async with Cluster(router=False) as c:
        status, answer = await asyncio.to_thread(post, c.decode.url + "/v1/completions", {**BODY, "max_tokens": 1})
        assert status == 400  # a decode alone needs the P/D fields: the server answered, from its own loop
        assert (answer["error"]["param"], answer["error"]["code"]) == ("bootstrap_room", "local_prefill_refused")
        pids = c.pids()
    assert len(pids) == 2 and [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []
