"""What router authors need to see, with the real routers in front of a disagg.testing Cluster:
sglang-router (push; it retries a failed request) and vllm-router (pull; it answers the failure).
Each scenario asserts what the client gets, what our servers answered the router (their
`disagg_requests_total` by status), and that nothing leaked. 3 s deadlines, 8 s pull leases,
heartbeats every 0.2 s."""

import json
import re
import threading
import time
import urllib.request

import pytest

from disagg.pd_config import ControlConfig
from disagg.testing import Cluster
from disagg.testing.http import post
from real_router import PROTOCOL, real_router

pytestmark = pytest.mark.timeout(240)
pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency: pip install -e '.[dev]'")
pytest.importorskip("vllm_router", reason="vllm-router is a dev dependency: pip install -e '.[dev]'")
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
DEADLINES = {"waiting_timeout_s": 3, "bootstrap_timeout_s": 3, "kv_lease_s": 8,
             "control": ControlConfig(heartbeat_interval_s=0.2, heartbeat_max_misses=3)}


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def setup(request, tmp_path_factory):
    """(router kind, its URL, the cluster: prefill dp 2, decode dp 1, faults on)."""
    with Cluster(router=False, fault_injection=True, protocol=PROTOCOL[request.param], prefill_dp=2,
                 disagg=DEADLINES) as cluster:
        with real_router(request.param, cluster, tmp_path_factory.mktemp(request.param)) as url:
            yield request.param, url, cluster


def ask(url: str, body: dict = BODY) -> tuple[int, object, float]:
    start = time.monotonic()
    status, answer = post(url + "/v1/completions", body)
    return status, answer, time.monotonic() - start


def in_background(url: str) -> tuple[threading.Thread, list]:
    results: list = []
    thread = threading.Thread(target=lambda: results.append(ask(url)))
    thread.start()
    return thread, results


def answered(server) -> dict[str, float]:
    """How many completions the server answered, by status."""
    return {ls["status"]: v for n, ls, v in server.metrics().samples
            if n == "disagg_requests_total" and ls["endpoint"] == "/v1/completions"}


def errors_since(server, before: dict[str, float]) -> float:
    return sum(v - before.get(s, 0) for s, v in answered(server).items() if s != "200")


def until_running(server, timeout_s: float = 10.0) -> None:
    """Until the server holds a request (its /load, counted as it arrives), then 0.3 s for its worker to
    take it (its slowed steps keep it there)."""
    deadline = time.monotonic() + timeout_s
    while json.loads(urllib.request.urlopen(server.url + "/load", timeout=5).read())["server_load"] < 1:
        assert time.monotonic() < deadline, f"no request reached {server.url} within {timeout_s:g} s"
        time.sleep(0.02)
    time.sleep(0.3)


def text(cluster) -> str:
    return cluster.reference("/v1/completions", BODY)["choices"][0]["text"]


def test_a_prefill_worker_dies_mid_request(setup):
    kind, url, cluster = setup
    before = answered(cluster.prefill)
    for rank in (0, 1):
        cluster.prefill.faults.slow_steps(rank, 1500)  # the request is still on its prefill worker when it dies
    thread, results = in_background(url)
    until_running(cluster.prefill)  # not a fixed wait: a loaded host may take longer to route it there
    for rank in (0, 1):
        cluster.prefill.faults.kill(rank)
    thread.join()
    [(status, answer, _)] = results
    assert errors_since(cluster.prefill, before) >= 1  # the prefill answered the router: its worker died
    if kind == "sglang":  # it sends the request again, to the restarted worker
        assert (status, answer["choices"][0]["text"]) == (200, text(cluster))
    else:
        assert status == 500
        assert re.fullmatch(r"Transparent proxy request failed: Network error: Prefill server http://127\.0\.0\.1:\d+"
                            r"/v1/completions returned 503 Service Unavailable: \{\"error\":\{\"message\":\"DP worker "
                            r"\d died \(closed its connection\)\",.*", answer)
    deadline = time.monotonic() + 60
    while not all(w.ready and w.restarts == 1 for w in cluster.prefill.workers()):
        assert time.monotonic() < deadline, cluster.prefill.workers()
        time.sleep(0.1)
    assert ask(url)[0] == 200
    cluster.assert_no_leaks()


def test_a_decode_stalls_past_the_bootstrap_timeout(setup):
    kind, url, cluster = setup
    before = answered(cluster.prefill)
    cluster.decode.faults.stall(0, seconds=5)
    status, answer, seconds = ask(url)
    assert (status, answer["choices"][0]["text"]) == (200, text(cluster)) and seconds >= 5  # served once it resumes
    if kind == "sglang":  # the prefill gave the room up at its 3 s deadline; the router sent it again
        assert errors_since(cluster.prefill, before) >= 1
    else:  # pull: the prefill's lease (8 s) outlives the stall, and the decode claims it
        assert errors_since(cluster.prefill, before) == 0
    cluster.assert_no_leaks(timeout_s=15)


def test_transfers_slow_down_under_load(setup):
    kind, url, cluster = setup
    mover = cluster.prefill if kind == "sglang" else cluster.decode  # push: the prefill writes; pull: the decode reads
    for worker in mover.workers():
        mover.faults.delay_transfers(worker.rank, count=3, seconds=1.0)
    burst = [in_background(url) for _ in range(3)]
    for thread, _ in burst:
        thread.join()
    results = [r for _, rs in burst for r in rs]
    assert [(s, a["choices"][0]["text"]) for s, a, _ in results] == [(200, text(cluster))] * 3
    assert all(seconds >= 1.0 for _, _, seconds in results)
    cluster.assert_no_leaks()


def test_a_dp_rank_conflict_under_follow_bootstrap_room(setup):
    kind, url, cluster = setup
    if kind == "vllm":
        pytest.skip("the pull flow has no bootstrap rooms: nothing to conflict with")
    before = answered(cluster.prefill)
    # sglang-router passes routed_dp_rank on and draws the room: about one request in two names a rank
    # the room does not imply. The prefill refuses those (400 naming routed_dp_rank, its decode leg
    # 500 with the same text); the router sends them again with new rooms, and may give up.
    results = [ask(url, {**BODY, "routed_dp_rank": 0}) for _ in range(12)]
    conflict = re.compile(r"bootstrap_room \d+ was dispatched to prefill DP rank 0, but load_balance_method "
                          r"follow_bootstrap_room implies rank 1 \(room % dp_size=2\)")
    for status, answer, _ in results:
        assert (answer["choices"][0]["text"] == text(cluster)) if status == 200 else conflict.search(str(answer))
    assert answered(cluster.prefill).get("400", 0) - before.get("400", 0) >= 1
    cluster.assert_no_leaks()


def test_a_draining_decode_finishes_what_it_has_and_refuses_the_rest(setup):
    kind, url, cluster = setup  # last: the decode stays drained
    cluster.decode.faults.slow_steps(0, 300)
    thread, results = in_background(url)
    time.sleep(0.8)
    drain = threading.Thread(target=cluster.decode.drain, args=(20,))
    drain.start()
    time.sleep(0.3)
    status, answer, _ = ask(url)
    thread.join()
    drain.join()
    assert [(s, a["choices"][0]["text"]) for s, a, _ in results] == [(200, text(cluster))]
    assert status == 503
    if kind == "sglang":  # its own body, once its retries are spent
        assert (answer["error"]["code"], answer["error"]["message"]) == (
            "decode_unavailable", "server is draining: it accepts no new requests")
    else:
        assert (answer["error"]["code"], answer["error"]["message"]) == (
            "draining", "server is draining: it accepts no new requests")
    # pull: the refused request's prefill leg leased its blocks; the lease expires after 8 s
    cluster.assert_no_leaks(timeout_s=20)


def test_a_registry_restart_under_sglang_router(tmp_path):
    """Every decode asks the registry for its room's rank (DISAGG_FORCE_QUERY_PREFILL_DP_RANK); the
    registry restarts empty; the prefill ranks register again within 0.3 s, and the decode asks again
    until they did: the router sees nothing but 200s."""
    disagg = {**DEADLINES, "registry_refresh_s": 0.3, "force_query_prefill_dp_rank": True}
    with Cluster(router=False, prefill_dp=2, disagg=disagg) as cluster:
        with real_router("sglang", cluster, tmp_path) as url:
            assert ask(url)[0] == 200
            before = answered(cluster.decode)
            cluster.prefill.restart_registry(wait=False)
            results = [ask(url) for _ in range(4)]
            assert [(s, a["choices"][0]["text"]) for s, a, _ in results] == [(200, text(cluster))] * 4
            assert errors_since(cluster.decode, before) == 0
            # The four rooms may all have come from one rank: the other re-registers on its own
            # refresh (every 0.3 s), bounded here at 3 s.
            registry, deadline = cluster.prefill.running.bootstrap.registry, time.monotonic() + 3
            while registry.num_registered < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert registry.num_registered == 2
            cluster.assert_no_leaks()
