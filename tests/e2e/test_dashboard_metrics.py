"""The Grafana dashboard (deploy/k8s/monitoring/grafana-dashboard.json) queries only metrics that a
live P/D cluster's servers and our router export."""

import json
import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
DASHBOARD = pathlib.Path(__file__).parents[2] / "deploy" / "k8s" / "monitoring" / "grafana-dashboard.json"
METRIC = re.compile(r"(?<![\w:])((?:vllm:|disagg_|smg_|sgl_router_)[A-Za-z0-9_:]+)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(exprs) == 25
    return {name for expr in exprs for name in METRIC.findall(expr)}


def exported(text: str) -> set[str]:
    """Every sample name a /metrics text has or declares (a labelled counter with no child yet still has its TYPE)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


async def test_every_dashboard_query_names_an_exported_metric(cluster):
    router = RouterServer(RouterConfig(port=0, health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(cluster.prefill_url, cluster.prefill.bootstrap_port),)))
    await router.start()
    try:
        status, _, _ = await cluster.post(router.url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}, None)
        assert status == 200
        names = set()
        for url in (cluster.prefill_url, cluster.decode_url, router.url):
            async with cluster.session.get(url + "/metrics") as resp:
                names |= exported(await resp.text())
    finally:
        await router.close()
    wanted = dashboard_metrics()
    assert len(wanted) == 23 and sorted(wanted - names) == []
