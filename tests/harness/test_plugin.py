"""The pytest plugin as a router project uses it: this file imports nothing from disagg; the
`disagg_cluster` fixtures come from the installed entry point (pytest11)."""

import json
import os
import urllib.request

import pytest

pytestmark = [pytest.mark.timeout(180), pytest.mark.disagg_cluster(prefill_dp=2, decode_dp=1)]
BODY = {"model": "tiny", "prompt": "a router under test", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def completion(url: str) -> dict:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(BODY).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def test_the_module_cluster_follows_the_module_marker(disagg_cluster):
    assert [w.rank for w in disagg_cluster.prefill.workers()] == [0, 1]
    answer = completion(disagg_cluster.router_url)
    assert answer["choices"][0]["text"] == disagg_cluster.reference("/v1/completions", BODY)["choices"][0]["text"]
    assert answer["usage"]["completion_tokens"] == 6
    disagg_cluster.assert_no_leaks()


@pytest.mark.parametrize("disagg_cluster_per_test", [{"protocol": "pull"}], indirect=True)
def test_a_parametrized_cluster_speaks_the_pull_protocol(disagg_cluster_per_test):
    cluster = disagg_cluster_per_test
    assert cluster.protocol == "pull" and len(cluster.prefill.workers()) == 1  # the parameter replaces the marker
    answer = completion(cluster.router_url)
    assert answer["choices"][0]["text"] == cluster.reference("/v1/completions", BODY)["choices"][0]["text"]
    assert cluster.decode.metrics().value("disagg_kv_transfer_bytes_total") > 0
    cluster.assert_no_leaks()


@pytest.fixture
def pids_gone_after_teardown():
    """Set up before the factory (it comes first in the test's arguments), so torn down after it:
    every pid the test records must be gone by then."""
    pids: list[int] = []
    yield pids
    assert len(pids) == 3 and [pid for pid in pids if os.path.exists(f"/proc/{pid}")] == []


def test_the_factory_starts_clusters_and_stops_them_after_the_test(pids_gone_after_teardown, disagg_cluster_factory):
    cluster = disagg_cluster_factory(router=False, decode_dp=2)
    with pytest.raises(RuntimeError, match="this cluster runs without a router"):
        cluster.router_url
    with urllib.request.urlopen(cluster.decode.url + "/health", timeout=10) as resp:
        assert resp.status == 200
    pids_gone_after_teardown.extend(cluster.pids())
    assert len(pids_gone_after_teardown) == 3
