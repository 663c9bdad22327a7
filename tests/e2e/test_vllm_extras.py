"""vLLM's request fields beyond OpenAI's, on a unified server and through our router on P/D (tiny
model, greedy): `prompt_logprobs` (computed by the prefill, equal to unified's), `truncate_prompt_tokens`
with `truncation_side`, `return_token_ids`, `return_tokens_as_token_ids`; answers that did not ask
carry `prompt_logprobs: null`, as vLLM's do."""

import json

import pytest


pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True, "max_tokens": 4}
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": PROMPT}]


async def answer(cluster, url: str, path: str, body: dict) -> dict:
    status, data, _ = await cluster.post(url + path, body, None)
    assert status == 200, data
    return data


async def test_prompt_logprobs_through_pd_equal_unifieds(cluster, unified_url, router_url):
    ids = (await answer(cluster, unified_url, "/tokenize", {"prompt": PROMPT}))["tokens"]
    for path, body, where in (("/v1/completions", {"prompt": PROMPT}, lambda a: a["choices"][0]),
                              ("/v1/chat/completions", {"messages": CHAT}, lambda a: a)):
        request = {**GREEDY, **body, "prompt_logprobs": 1}
        unified = where(await answer(cluster, unified_url, path, request))["prompt_logprobs"]
        pd = where(await answer(cluster, router_url, path, request))["prompt_logprobs"]
        assert pd == unified and unified[0] is None
        if path == "/v1/completions":  # each entry: the prompt's own next token first, then the top-1
            assert [next(iter(e)) for e in unified[1:]] == [str(t) for t in ids[1:]]
            assert all(1 <= len(e) <= 2 and all(list(v) == ["logprob", "rank", "decoded_token"] for v in e.values())
                       for e in unified[1:])
            # the top-1 is rank 1; the prompt's token, where it is not the top-1, ranks below it
            assert [sorted(v["rank"] for v in e.values())[0] for e in unified[1:]] == [1] * (len(ids) - 1)
            assert all(len(e) == 1 or e[str(t)]["rank"] > 1 for e, t in zip(unified[1:], ids[1:]))
        plain = where(await answer(cluster, router_url, path, {**GREEDY, **body}))
        assert plain["prompt_logprobs"] is None  # the field is there, null, when not asked
        for url in (unified_url, router_url):  # a stream has no place for them: refused as vLLM refuses them
            status, text, _ = await cluster.post(url + path, {**request, "stream": True}, None)
            data = json.loads(text)  # a 400, not a stream
            assert (status, data["error"]["param"], data["error"]["message"]) == (
                400, "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`.")


async def test_truncation_and_token_ids(cluster, unified_url, router_url):
    ids = (await answer(cluster, unified_url, "/tokenize", {"prompt": PROMPT}))["tokens"]
    assert len(ids) > 6
    for url in (unified_url, router_url):
        for side, kept in (("left", ids[-4:]), ("right", ids[:4])):
            body = {**GREEDY, "prompt": PROMPT, "truncate_prompt_tokens": 4, "truncation_side": side,
                    "return_token_ids": True}
            whole = await answer(cluster, url, "/v1/completions", body)
            choice = whole["choices"][0]
            assert (whole["usage"]["prompt_tokens"], choice["prompt_token_ids"]) == (4, kept)
            same = await answer(cluster, unified_url, "/inference/v1/generate", {
                "token_ids": kept, "sampling_params": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}})
            assert choice["token_ids"] == same["choices"][0]["token_ids"]
    chat = await answer(cluster, router_url, "/v1/chat/completions", {**GREEDY, "messages": CHAT, "return_token_ids": True})
    assert len(chat["choices"][0]["token_ids"]) == 4 and chat["usage"]["prompt_tokens"] == len(chat["prompt_token_ids"])
    bad = await cluster.post(unified_url + "/v1/completions", {**GREEDY, "prompt": PROMPT, "truncate_prompt_tokens": 0}, None)
    assert (bad[0], bad[1]["error"]["message"]) == (400, "truncate_prompt_tokens must be -1 or at least 1, got 0")


async def test_tokens_as_token_ids(cluster, unified_url):
    whole = await answer(cluster, unified_url, "/v1/completions", {**GREEDY, "prompt": PROMPT, "logprobs": 1,
                                                                   "return_tokens_as_token_ids": True,
                                                                   "return_token_ids": True})
    choice = whole["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    chat = await answer(cluster, unified_url, "/v1/chat/completions", {**GREEDY, "messages": CHAT, "logprobs": True,
                                                                      "return_tokens_as_token_ids": True,
                                                                      "return_token_ids": True})
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert [c["bytes"] for c in content] == [list(c["token"].encode()) for c in content]


async def test_streamed_token_ids(cluster, router_url):
    import json
    body = {**GREEDY, "prompt": PROMPT, "return_token_ids": True}
    whole = (await answer(cluster, router_url, "/v1/completions", body))["choices"][0]
    status, raw, _ = await cluster.post(router_url + "/v1/completions", {**body, "stream": True}, None)
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert status == 200 and events[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == whole["token_ids"]
    chat = {**GREEDY, "messages": CHAT, "return_token_ids": True, "stream": True}
    status, raw, _ = await cluster.post(router_url + "/v1/chat/completions", chat, None)
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    assert "prompt_token_ids" in events[0] and "token_ids" not in events[0]["choices"][0]  # the role chunk
    assert sum(len(e["choices"][0]["token_ids"]) for e in events[1:]) == 4
