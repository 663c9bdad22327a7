"""Our router's selective disaggregation against fake servers: it learns what the decode answered,
so the next turn's rest is counted from the end of that answer and goes to the decode alone."""

import json

import pytest

from disagg.router.config import CacheAwareConfig
from test_router import FakeServer, cluster, json_answer, metric_values, post, sse_answer, get

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]
ANSWER = "The capital of France is Paris, a large city."  # 45 characters: 12 tokens to the router
TURN_1 = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "What is the capital of France?"}]
TURN_2 = TURN_1 + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "And Spain?"}]


def decode_answer(stream: bool):
    if not stream:
        return json_answer({"choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER}}]})
    events = [{"choices": [{"index": 0, "delta": {"content": ANSWER[:20]}}]},
              {"choices": [{"index": 0, "delta": {"content": ANSWER[20:]}}]}]
    return sse_answer([b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_the_next_turn_after_a_learned_answer_goes_to_the_decode_alone(stream):
    prefill, decode = FakeServer(), FakeServer(decode_answer(stream), server_info={"max_local_prefill_tokens": 4})
    config = CacheAwareConfig(local_prefill_min_prefill_load=0)  # the prefill is idle here
    async with cluster([prefill], [decode], policy="cache_aware", cache_aware=config) as router:
        first = await post(router, "/v1/chat/completions", {"messages": TURN_1, "stream": stream})
        # The decode's tree holds turn 1's text and the answer: " And Spain?" is 11 characters, 3 tokens.
        second = await post(router, "/v1/chat/completions", {"messages": TURN_2, "stream": stream})
        _, _, metrics = await get(router, "/metrics")
    assert (first[0], first[1]["X-Disagg-Path"], "X-Disagg-Path-Reason" in first[1]) == (200, "pd", False)
    assert (second[0], second[1]["X-Disagg-Path"], second[1]["X-Disagg-Path-Reason"]) == (
        200, "decode-local", "short_uncached_rest")
    assert len(prefill.bodies) == 1 and prefill.bodies[0]["messages"] == TURN_1
    assert "bootstrap_room" in decode.bodies[0] and "bootstrap_room" not in decode.bodies[1]
    assert decode.bodies[1] == {"messages": TURN_2, "stream": stream}  # as the client sent it
    assert metric_values(metrics, "disagg_router_prefills_total") == {
        'disagg_router_prefills_total{where="local"}': 1.0, 'disagg_router_prefills_total{where="remote"}': 1.0}
    assert metric_values(metrics, "disagg_router_answers_total") == {
        'disagg_router_answers_total{path="decode-local",reason="short_uncached_rest"}': 1.0,
        'disagg_router_answers_total{path="pd",reason=""}': 1.0}


async def test_an_answer_the_router_cannot_read_is_not_learned():
    prefill, decode = FakeServer(), FakeServer(json_answer({"choices": [{"index": 0, "text": ANSWER},
                                                                        {"index": 1, "text": "other"}]}),
                                               server_info={"max_local_prefill_tokens": 4})
    config = CacheAwareConfig(local_prefill_min_prefill_load=0)
    async with cluster([prefill], [decode], policy="cache_aware", cache_aware=config) as router:
        for messages in (TURN_1, TURN_2):
            assert (await post(router, "/v1/chat/completions", {"messages": messages}))[0] == 200
    # Two choices (n = 2): no answer continues the conversation, so turn 2's 12 + 3 tokens go with a prefill.
    assert [len(prefill.bodies), *("bootstrap_room" in b for b in decode.bodies)] == [2, True, True]
