"""A P/D cluster across real network namespaces (disagg.testing.NetnsCluster): our router, a
standalone bootstrap registry, the prefill and the decode each in a namespace of its own on a bridge
the test makes (veth pairs; removed afterwards), binding their own addresses, with a cluster secret
and HTTPS on the router and both servers (a throwaway CA naming each address). Through the router,
P/D over tcp and nixl answers as unified does; a link cut while the prefill's KV crawls over a
slowed link (tc tbf) ends the request clearly (or it completes, equal to unified), leaks nothing, and
the cluster serves again once the link returns; netem's delay and loss, where the kernel has netem.
Skipped, saying why, where namespaces (or netem) cannot be made."""

import json
import threading
import time

import pytest

from disagg.testing import NetnsCluster, TlsFiles, namespaces_unavailable, qdisc_unavailable
from tls_files import write_tls_files

pytestmark = [pytest.mark.timeout(300)]
LONG = "The quick brown fox jumps over the lazy dog. " * 10  # ~450 tokens: ~225 KB of tiny's KV
BODY = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 6,
        "temperature": 0, "ignore_eos": True}
SLOW_LINK = ("tbf", "rate", "800kbit", "burst", "16kb", "latency", "2s")  # a 225 KB transfer: ~2 s
NETEM = ("netem", "delay", "20ms", "loss", "1%")
# Short deadlines, so that a cut link ends the request in seconds.
ARGS = {"prefill": ["--bootstrap-timeout-s", "5", "--transfer-timeout-s", "5"],
        "decode": ["--waiting-timeout-s", "8", "--connect-timeout-s", "2", "--abort-ack-timeout-s", "2"],
        "router": ["--request-timeout-s", "60"]}


def tls_cluster(tmp_path, backend: str) -> NetnsCluster:
    """A NetnsCluster (not started) whose router and servers serve HTTPS with a certificate naming their addresses."""
    why = namespaces_unavailable()
    if why is not None:
        pytest.skip(f"network namespaces cannot be made here: {why}")
    # nixl's KV crosses the bridge over UCX's tcp transport, as between hosts (on one host UCX would
    # pick shared memory, which no link cut touches).
    cluster = NetnsCluster(backend=backend, args=ARGS, env={"UCX_TLS": "tcp"} if backend == "nixl" else None)
    files = write_tls_files(tmp_path, tuple(cluster.addresses.values()))
    cluster.tls = TlsFiles(files.ca, files.certfile, files.keyfile)
    return cluster


def stream_text(raw: str) -> str:
    return "".join(c["text"] for line in raw.splitlines() if line.startswith("data: {")
                   for c in json.loads(line[6:])["choices"])


def waiting_for_kv(cluster: NetnsCluster) -> float:
    """The decode's requests whose KV is on its way (asked of the decode: the prefill's own answers
    queue behind its KV on the slowed link)."""
    return cluster.decode.metrics().value("sglang:num_decode_transfer_queue_reqs")


@pytest.mark.parametrize("backend", ["tcp", "nixl"])
def test_pd_across_namespaces_equals_unified_and_survives_a_link_cut_mid_transfer(tmp_path, backend):
    with tls_cluster(tmp_path, backend) as cluster:
        check_cut(cluster)


def check_cut(cluster: NetnsCluster) -> None:
    assert all(not a.startswith("127.") for a in cluster.addresses.values())
    assert cluster.router_url.startswith(f"https://{cluster.addresses['router']}:")
    want = cluster.reference("/v1/completions", BODY)["choices"][0]["text"]
    status, answer = cluster.post("/v1/completions", BODY)
    assert (status, answer["choices"][0]["text"]) == (200, want)
    status, raw = cluster.post("/v1/completions", {**BODY, "stream": True})
    assert (status, stream_text(raw)) == (200, want)
    long_body = {**BODY, "prompt": LONG}
    long_want = cluster.reference("/v1/completions", long_body)["choices"][0]["text"]
    cluster.assert_no_leaks()

    # The prefill's link slowed to ~100 KB/s: its KV takes ~2 s to cross. The decode waits for it
    # (its destination sent), the prefill computes the prompt in well under a second, then the link is cut.
    cluster.net.shape("prefill", *SLOW_LINK)
    answers = []
    client = threading.Thread(target=lambda: answers.append(cluster.post("/v1/completions", long_body)))
    client.start()
    deadline = time.monotonic() + 60
    while waiting_for_kv(cluster) < 1:
        assert time.monotonic() < deadline and client.is_alive(), ("the decode never waited for KV", answers)
        time.sleep(0.05)
    time.sleep(0.8)
    assert client.is_alive() and waiting_for_kv(cluster) == 1  # the KV is still crossing
    cluster.net.link("prefill", up=False)
    client.join(90)
    assert not client.is_alive()
    [(status, answer)] = answers
    if status == 200:  # the KV landed before the cut mattered (nixl may move it over shared memory)
        assert answer["choices"][0]["text"] == long_want
    else:
        assert status in (500, 502, 503, 504) and answer["error"]["message"], answer
    cluster.net.link("prefill", up=True)
    cluster.net.unshape("prefill")
    cluster.assert_no_leaks(timeout_s=30)  # nothing held on either side once the peers meet again
    for _ in range(40):  # the router's health check and the decode's peer come back
        status, answer = cluster.post("/v1/completions", long_body)
        if status == 200:
            break
        time.sleep(0.5)
    assert (status, answer["choices"][0]["text"]) == (200, long_want)
    cluster.assert_no_leaks()


def test_pd_across_namespaces_with_delay_and_loss(tmp_path):
    why = namespaces_unavailable() or qdisc_unavailable(*NETEM)
    if why is not None:
        pytest.skip(f"no netem here (the kernel's sch_netem qdisc): {why}")
    with tls_cluster(tmp_path, "tcp") as cluster:
        for name in ("prefill", "decode"):
            cluster.net.shape(name, *NETEM)
        want = cluster.reference("/v1/completions", {**BODY, "prompt": LONG})["choices"][0]["text"]
        for _ in range(3):
            status, answer = cluster.post("/v1/completions", {**BODY, "prompt": LONG})
            assert (status, answer["choices"][0]["text"]) == (200, want)
        cluster.assert_no_leaks()
