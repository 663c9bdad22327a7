"""The routes our router answers from one server (/v1/models, /version, /get_model_info,
/get_server_info, /tokenize, /detokenize), and its own metrics under sgl-model-gateway's names."""

import json

import pytest
from aiohttp import web

from test_router import FakeServer, cluster, get, metric_values, post

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class FullServer(FakeServer):
    """A decode stand-in that also answers the informational routes, recording what reached it."""

    def add_routes(self, app: web.Application) -> None:
        self.seen: list[tuple[str, str, bytes, str | None]] = []
        for path in ("/version", "/get_model_info", "/get_server_info"):
            app.router.add_get(path, self._info)
        for path in ("/tokenize", "/detokenize"):
            app.router.add_post(path, self._info)

    async def _info(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((request.method, request.path, body, request.headers.get("Authorization")))
        answers = {"/version": {"version": "0.9.0"}, "/get_model_info": {"model_path": "tiny", "is_generation": True},
                   "/get_server_info": {"dp_size": 2, "disaggregation_mode": "decode"},
                   "/tokenize": {"count": 2, "tokens": [5, 6], "max_model_len": 512},
                   "/detokenize": {"prompt": "hi"}}
        if request.path == "/tokenize" and not json.loads(body).get("prompt"):
            return web.json_response({"error": {"message": "send a prompt", "param": "prompt"}}, status=400)
        return web.json_response(answers[request.path])


async def test_informational_routes_come_from_a_decode_and_carry_the_clients_key():
    prefill, decode = FakeServer(), FullServer()
    auth = {"Authorization": "Bearer k"}
    async with cluster([prefill], [decode]) as router:
        answers = {path: await get(router, path, auth) for path in ("/version", "/get_model_info", "/get_server_info")}
        tokenized = await post(router, "/tokenize", {"prompt": "hi"}, auth)
        detokenized = await post(router, "/detokenize", {"tokens": [5, 6]}, auth)
        refused = await post(router, "/tokenize", {"messages": []}, auth)
        generated = await post(router, "/generate", {"text": "hi"}, auth)
        _, _, metrics = await get(router, "/metrics")
    assert [(s, json.loads(b)) for s, _, b in (answers["/version"], answers["/get_model_info"])] == [
        (200, {"version": "0.9.0"}), (200, {"model_path": "tiny", "is_generation": True})]
    info = json.loads(answers["/get_server_info"][2])
    assert (info["dp_size"], info["disaggregation_mode"]) == (2, "decode")
    assert [s["url"] for s in info["router"]["prefill"]] == [prefill.url] and info["router"]["decode"][0]["url"] == decode.url
    assert (tokenized[0], json.loads(tokenized[2])) == (200, {"count": 2, "tokens": [5, 6], "max_model_len": 512})
    assert (detokenized[0], json.loads(detokenized[2])) == (200, {"prompt": "hi"})
    assert (refused[0], json.loads(refused[2])["error"]["message"]) == (400, "send a prompt")
    assert [(m, p, a) for m, p, _, a in decode.seen] == [
        ("GET", "/version", "Bearer k"), ("GET", "/get_model_info", "Bearer k"), ("GET", "/get_server_info", "Bearer k"),
        ("POST", "/tokenize", "Bearer k"), ("POST", "/detokenize", "Bearer k"), ("POST", "/tokenize", "Bearer k")]
    assert json.loads(decode.seen[3][2]) == {"prompt": "hi"}
    requests = metric_values(metrics, "smg_http_requests_total")
    assert requests['smg_http_requests_total{method="POST",path="/tokenize"}'] == 2.0
    assert requests['smg_http_requests_total{method="GET",path="/version"}'] == 1.0
    responses = metric_values(metrics, "smg_http_responses_total")
    assert responses['smg_http_responses_total{error_code="",path="/tokenize",status_code="400"}'] == 1.0
    health = metric_values(metrics, "smg_worker_health")
    assert health == {f'smg_worker_health{{worker="{prefill.url}",worker_type="prefill"}}': 1.0,
                      f'smg_worker_health{{worker="{decode.url}",worker_type="decode"}}': 1.0}
    assert generated[0] == 200
    assert metric_values(metrics, "disagg_router_picks_total") == {
        f'disagg_router_picks_total{{role="decode",worker="{decode.url}"}}': 1.0,
        f'disagg_router_picks_total{{role="prefill",worker="{prefill.url}"}}': 1.0}
    assert metric_values(metrics, "smg_worker_requests_active") == {
        f'smg_worker_requests_active{{worker="{prefill.url}",worker_type="prefill"}}': 0.0,
        f'smg_worker_requests_active{{worker="{decode.url}",worker_type="decode"}}': 0.0}
    duration = metric_values(metrics, "smg_http_request_duration_seconds_count")
    assert duration['smg_http_request_duration_seconds_count{method="POST",path="/generate"}'] == 1.0
