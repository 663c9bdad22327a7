"""`n > 1` on a P/D pair (push flow): both legs fork into children with rooms `room + i`; each
child's answer equals the unified server's child with the same seed, and the blocks come back."""

import pytest

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_n_choices_on_pd_equal_unified_children(cluster, unified_url, path):
    if path == "/v1/completions":
        body = {"model": "tiny", "prompt": "Parallel sampling on a pair", "n": 3, **SEEDED}
    else:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Parallel sampling"}], "n": 3, **SEEDED}
    _, expected, _ = await cluster.post(unified_url + path, body, None)
    pd = cluster.pd_body(body)
    (p_status, p_data, _), (status, data, _) = await cluster.post_both(path, pd, pd)
    assert (p_status, status) == (200, 200), (p_data, data)
    answer = (lambda c: c["text"]) if path == "/v1/completions" else (lambda c: c["message"]["content"])
    assert [(c["index"], answer(c)) for c in data["choices"]] == [(c["index"], answer(c)) for c in expected["choices"]]
    assert len({answer(c) for c in data["choices"]}) == 3  # seeds 7, 8, 9: three different answers
    assert data["usage"] == expected["usage"] | {"prompt_tokens_details": data["usage"]["prompt_tokens_details"]}
    assert await cluster.settled(([96, 96], [96, 96])) == ([96, 96], [96, 96])


async def test_n_in_the_pull_flow_is_refused_naming_the_field(cluster):
    ticket = {"do_remote_decode": True, "do_remote_prefill": False}
    status, data, _ = await cluster.post(cluster.prefill_url + "/v1/completions", {
        "model": "tiny", "prompt": "x", "n": 2, "max_tokens": 1, "kv_transfer_params": ticket}, None)
    assert (status, data["error"]["param"]) == (400, "n")
    assert data["error"]["message"] == ("n > 1 is not supported in the pull flow (kv_transfer_params): each choice "
                                        "needs its own ticket; send n requests, or use the push flow or a unified server")
