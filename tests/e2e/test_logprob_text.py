"""Logprob tokens by their text, as vLLM writes them: each token decoded alone (vLLM's
convert_ids_list_to_tokens, here through the server's own /detokenize), completions' text_offset
cumulative from where the text starts, chat's bytes the token's UTF-8; the same on P/D."""

import pytest

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 6}
PROMPT = "Logprobs by their text"


async def expected_tokens(cluster, url: str) -> list[str]:
    _, generated, _ = await cluster.post(url + "/generate", {"text": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}, None)
    tokens = []
    for token_id in generated["output_ids"]:
        _, decoded, _ = await cluster.post(url + "/detokenize", {"tokens": [token_id]}, None)
        tokens.append(decoded["prompt"])
    return tokens


async def test_completion_and_chat_logprobs_name_tokens_by_text(cluster, unified_url):
    tokens = await expected_tokens(cluster, unified_url)
    _, completion, _ = await cluster.post(unified_url + "/v1/completions",
                                          {"model": "tiny", "prompt": PROMPT, "logprobs": 2, **GREEDY}, None)
    logprobs = completion["choices"][0]["logprobs"]
    # The tiny model's random tokens include <bos> and broken UTF-8: each is its own decode, as in vLLM
    # (the text itself skips special tokens, so it is not the tokens joined).
    assert logprobs["tokens"] == tokens
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert logprobs["text_offset"] == offsets
    assert all(token in top for token, top in zip(tokens, logprobs["top_logprobs"]))  # greedy: the best is the sampled
    messages = [{"role": "user", "content": PROMPT}]
    _, chat, _ = await cluster.post(unified_url + "/v1/chat/completions", {
        "model": "tiny", "messages": messages, "logprobs": True, "top_logprobs": 1, **GREEDY}, None)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all(not c["token"].startswith("token_id:") for c in content)
    assert [c["bytes"] for c in content] == [list(c["token"].encode()) for c in content]
    assert all(c["top_logprobs"][0]["token"] == c["token"] for c in content)


async def test_pd_logprobs_equal_unified(cluster, unified_url):
    body = {"model": "tiny", "prompt": PROMPT, "logprobs": 1, **GREEDY}
    _, expected, _ = await cluster.post(unified_url + "/v1/completions", body, None)
    pd = cluster.pd_body(body)
    _, (status, got, _) = await cluster.post_both("/v1/completions", pd, pd)
    assert status == 200
    assert got["choices"][0]["logprobs"]["tokens"] == expected["choices"][0]["logprobs"]["tokens"]
    assert got["choices"][0]["logprobs"]["text_offset"] == expected["choices"][0]["logprobs"]["text_offset"]


async def test_logprobs_zero_names_the_sampled_token_and_echo_the_prompts(cluster, unified_url):
    """vLLM's `logprobs: 0`: each top_logprobs entry holds the sampled token alone (and, with echo,
    each prompt token after the first its own); a sampled token outside the top-n leads the entry."""
    tokens = await expected_tokens(cluster, unified_url)
    _, completion, _ = await cluster.post(unified_url + "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "logprobs": 0, "echo": True, **GREEDY}, None)
    logprobs = completion["choices"][0]["logprobs"]
    generated = len(tokens)
    assert logprobs["tokens"][-generated:] == tokens
    assert logprobs["top_logprobs"][0] is None  # the first prompt token has none
    for token, lp, top in list(zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]))[1:]:
        assert top == {token: lp}
    _, sampled, _ = await cluster.post(unified_url + "/v1/completions", {
        "model": "tiny", "prompt": PROMPT, "logprobs": 1, "temperature": 1.0, "seed": 3, "max_tokens": 12}, None)
    entries = sampled["choices"][0]["logprobs"]
    for token, top in zip(entries["tokens"], entries["top_logprobs"]):
        assert next(iter(top)) == token and len(top) in (1, 2)  # two tokens may share a text ('\ufffd')
