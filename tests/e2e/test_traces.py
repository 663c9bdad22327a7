"""OpenTelemetry traces through `disagg serve`'s cluster (start_cluster, as the command runs it) with
--otlp-traces-endpoint: a real OTLP/HTTP receiver here decodes the protobuf the SDK exports. One
request's router, prefill and decode spans share the client's trace id; the servers' spans nest under
the router's, the router's under the client's; each has its phases and the attributes the docs name,
with exact values where they are exact."""

import asyncio
import secrets

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from disagg.cluster import ClusterOptions, start_cluster
from disagg.config import ServerConfig
from pd_cluster import TINY, pd_config, start_pd

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]


def value_of(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: every span it was sent, with its service."""

    def __init__(self):
        self.spans: list[dict] = []

    async def export(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in message.resource_spans:
            resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self.spans.append({
                        "service": resource["service.name"], "name": span.name, "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                        "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                        "attributes": {a.key: value_of(a.value) for a in span.attributes},
                        "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links]})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf")

    def one(self, name: str) -> dict:
        found = [s for s in self.spans if s["name"] == name]
        assert len(found) == 1, (name, [s["name"] for s in self.spans])
        return found[0]


async def start_receiver() -> tuple[Receiver, web.AppRunner, str]:
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.export)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return receiver, runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/traces"


async def test_one_request_is_one_trace_across_router_prefill_and_decode():
    receiver, runner, endpoint = await start_receiver()
    prefill, decode, router = await start_cluster(TINY, pd_config("tcp"), ClusterOptions(
        port=0, servers=ServerConfig(dp_size=1, otlp_traces_endpoint=endpoint)))
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    try:
        assert (router.config.otlp_traces_endpoint, prefill.controller.server.otlp_traces_endpoint,
                decode.controller.server.otlp_traces_endpoint) == (endpoint, endpoint, endpoint)
        body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as session:
            async with session.post(router.url + "/v1/completions", json=body,
                                    headers={"traceparent": f"00-{trace_id}-{client_span}-01"}) as r:
                assert r.status == 200
                chunks = [line async for line in r.content if line.startswith(b"data: {")]
        assert len(chunks) == 4
    finally:
        await router.close()
        await asyncio.gather(prefill.close(), decode.close())  # each sends the spans it holds
        await runner.cleanup()
    spans = receiver.spans
    assert {s["trace_id"] for s in spans} == {trace_id}
    top = receiver.one("router /v1/completions")
    p, d = receiver.one("prefill /v1/completions"), receiver.one("decode /v1/completions")
    assert (top["service"], p["service"], d["service"]) == ("disagg-router", "disagg-prefill", "disagg-decode")
    assert (top["parent"], p["parent"], d["parent"]) == (client_span, top["span_id"], top["span_id"])
    children = {(s["parent"], s["name"]) for s in spans}
    assert {(top["span_id"], "router.pick"), (top["span_id"], "router.prefill_leg")} <= children
    assert {(p["span_id"], n) for n in ("bootstrap_wait", "prefill", "kv_transfer")} <= children
    assert {(d["span_id"], n) for n in ("kv_wait", "first_token", "generation")} <= children
    a, pa, da = top["attributes"], p["attributes"], d["attributes"]
    assert (a["disaggregation_used"], a["reason"], a["retries"]) == (True, "pd", 0)
    assert (a["prefill"], a["decode"]) == (f"http://127.0.0.1:{prefill.port}", f"http://127.0.0.1:{decode.port}")
    assert a["bootstrap_room"] == pa["bootstrap_room"] == da["bootstrap_room"]
    assert a["http.response.status_code"] == pa["http.response.status_code"] == da["http.response.status_code"] == 200
    assert 0 < a["prefill_duration_ms"] and 0 < a["true_ttft_ms"] and 0 <= a["decode_duration_ms"]
    assert (pa["prompt_tokens"], da["prompt_tokens"], da["completion_tokens"], da["finish_reason"]) == (44, 44, 4, "length")
    assert pa["kv_bytes"] == da["kv_bytes"] > 0 and pa["kv_transfer_overhead_ms"] >= 0 and pa["prefill_duration_ms"] > 0
    assert (da["disaggregation_used"], da["true_ttft_ms"] > 0, da["decode_duration_ms"] >= 0) == (True, True, True)
    assert p["links"] == [(trace_id, d["span_id"])]  # the decode's context, sent with the room's TransferInfo
    assert pa["decode_traceparent"] == f"00-{trace_id}-{d['span_id']}-01"
    for s in spans:  # every child lies within its parent's time, give or take the clocks' reading
        parent = next((q for q in spans if q["span_id"] == s["parent"]), None)
        if parent is not None:
            assert parent["start"] - 5_000_000 <= s["start"] <= s["end"] <= parent["end"] + 5_000_000, (s["name"], parent["name"])


async def test_without_a_callers_context_the_prefill_links_to_the_decodes_trace():
    """Legs sent by a router that traces nothing (no traceparent): each server starts its own trace,
    and the prefill's span links to the decode's, whose context came over the control plane."""
    receiver, runner, endpoint = await start_receiver()
    cluster = await start_pd("tcp", server={"otlp_traces_endpoint": endpoint}, dp_size=1)
    try:
        body = cluster.pd_body({"text": "The quick brown fox", "sampling_params": {"max_new_tokens": 3}})
        (p_status, _, _), (d_status, _, _) = await cluster.post_both("/generate", body, body)
        assert (p_status, d_status) == (200, 200)
    finally:
        await cluster.close()
        await runner.cleanup()
    p, d = receiver.one("prefill /generate"), receiver.one("decode /generate")
    assert p["trace_id"] != d["trace_id"] and (p["parent"], d["parent"]) == ("", "")
    assert p["links"] == [(d["trace_id"], d["span_id"])]
    assert p["attributes"]["bootstrap_room"] == d["attributes"]["bootstrap_room"] == body["bootstrap_room"]
