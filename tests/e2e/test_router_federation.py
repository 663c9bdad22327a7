"""One scrape of the router shows the cluster: its /metrics carries the servers' vllm:* and sglang:*
families, each series the sum of the prefill's and the decode's (real servers, our router, a request
through it); the router's own families stay; a server that is gone is left out and counted."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer
from router_process import free_port

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
SUMMED = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
          "vllm:e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_bucket",
          "vllm:iteration_tokens_total_count", "vllm:num_requests_running", "vllm:num_requests_waiting_by_reason",
          "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_transfer_queue_reqs",
          "sglang:kv_transfer_latency_ms_count", "sglang:num_transfer_failed_reqs_total")


async def summed_and_servers(cluster, router_url: str) -> tuple[dict, list[dict]]:
    """The router's samples and each server's, taken while the servers' SUMMED series held still (a
    worker's step figures reach its front a moment after the answer: a scrape between two could differ)."""
    urls = (cluster.prefill_url, cluster.decode_url)
    held = lambda scrape: [{k: v for k, v in s.items() if k[0] in SUMMED} for s in scrape]  # noqa: E731
    for _ in range(50):
        before = [await samples(cluster.session, url) for url in urls]
        summed = await samples(cluster.session, router_url)
        after = [await samples(cluster.session, url) for url in urls]
        if held(before) == held(after):
            return summed, after
        await asyncio.sleep(0.1)
    raise AssertionError("the servers' metrics did not hold still for one scrape in 50")


async def samples(session, url: str) -> dict[tuple[str, tuple], float]:
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def test_the_routers_metrics_add_up_its_servers(cluster):
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),)))
    await router.start()
    try:
        for text in ("hi", "The quick brown fox jumps over the lazy dog"):
            status, _, _ = await cluster.post(router.url + "/generate",
                                              {"text": text, "sampling_params": {"max_new_tokens": 3}}, None)
            assert status == 200
        summed, servers = await summed_and_servers(cluster, router.url)
        compared = 0
        for key, value in summed.items():
            if key[0] in SUMMED:
                assert value == sum(s.get(key, 0.0) for s in servers), key
                compared += 1
        assert compared >= 40, compared
        assert {k[0] for k in summed} >= set(SUMMED)
        tokens = [k for k in summed if k[0] == "vllm:prompt_tokens_total"]
        assert sum(summed[k] for k in tokens) > 0
        assert any(k[0] == "smg_http_requests_total" for k in summed)  # the router's own families stay
        assert not any(k[0].startswith("disagg_num_free_blocks") for k in summed)
        assert summed[("disagg_router_federation_failures_total", ())] == 0
    finally:
        await router.close()


async def test_a_server_that_does_not_answer_is_left_out_and_counted(cluster):
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(f"http://127.0.0.1:{free_port()}", free_port()),)))
    await router.start()
    try:
        summed = await samples(cluster.session, router.url)
        decode = await samples(cluster.session, cluster.decode_url)
        key = ("vllm:num_requests_running", (("engine", "0"), ("model_name", "tiny")))
        assert summed[key] == decode[key] == 0
        assert summed[("disagg_router_federation_failures_total", ())] == 1
    finally:
        await router.close()


async def test_each_answer_says_how_long_its_kv_took(cluster):
    """A P/D answer through the router carries the decode's wait for its KV (X-Disagg-KV-Wait-Ms) and
    the bytes that moved (X-Disagg-KV-Bytes, as the decode counted them), streamed or not; the
    router observes the wait by path."""
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),)))
    await router.start()
    try:
        before = (await samples(cluster.session, cluster.decode_url)).get(("disagg_kv_transfer_bytes_total", ()), 0.0)
        moved = []
        for stream in (False, True):
            body = {"model": "tiny", "prompt": f"KV wait {stream}: the quick brown fox", "max_tokens": 3,
                    "stream": stream}
            async with cluster.session.post(router.url + "/v1/completions", json=body) as r:
                await r.read()
                assert (r.status, r.headers["X-Disagg-Path"]) == (200, "pd")
                assert float(r.headers["X-Disagg-KV-Wait-Ms"]) > 0
                moved.append(int(r.headers["X-Disagg-KV-Bytes"]))
        after = (await samples(cluster.session, cluster.decode_url))[("disagg_kv_transfer_bytes_total", ())]
        assert sum(moved) == after - before and all(m > 0 for m in moved)
        summed = await samples(cluster.session, router.url)
        assert summed[("disagg_router_kv_wait_seconds_count", (("path", "pd"),))] == 2
    finally:
        await router.close()
