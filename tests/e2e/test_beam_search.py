"""`use_beam_search` (vLLM's OpenAI server's) on a unified server and through our router on P/D,
tiny model: the beams equal a reference beam search written here over the same engine's logprobs
(one /v1/completions call per beam and step); P/D answers equal unified's with one prompt's KV moved;
`n > 1` with a list of prompts; what beam search refuses."""

import json

import pytest

from disagg.engine.models.tiny import EOS_ID, IM_END_ID
from disagg.router.config import PrefillEndpoint, RouterConfig
from disagg.router.server import RouterServer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
PROMPT = "The quick brown fox"
BEAMS = {"model": "tiny", "prompt": PROMPT, "use_beam_search": True, "n": 4, "max_tokens": 5,
         "return_token_ids": True, "logprobs": 0}


async def answer(cluster, url: str, body: dict, path: str = "/v1/completions") -> dict:
    status, data, _ = await cluster.post(url + path, body, None)
    assert status == 200, data
    return data


async def top_tokens(cluster, url: str, token_ids: list[int], num: int) -> list[tuple[int, float]]:
    """The engine's top `num` next tokens after `token_ids`, best first."""
    body = {"model": "tiny", "prompt": token_ids, "max_tokens": 1, "temperature": 0, "logprobs": num,
            "return_tokens_as_token_ids": True}
    [top] = (await answer(cluster, url, body))["choices"][0]["logprobs"]["top_logprobs"]
    assert len(top) == num
    return sorted(((int(k.removeprefix("token_id:")), lp) for k, lp in top.items()), key=lambda p: -p[1])


async def reference_beams(cluster, url: str, prompt_ids: list[int], width: int, max_tokens: int,
                          length_penalty: float) -> list[tuple[list[int], float, str]]:
    """Beam search as HF and vLLM define it: 2 x width candidates a beam; an EOS ends its beam;
    score = sum of logprobs / (prompt + generated tokens) ** length_penalty."""
    live, ended = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, total in live:
            for token, logprob in await top_tokens(cluster, url, prompt_ids + tokens, 2 * width):
                if token in (EOS_ID, IM_END_ID):
                    ended.append((tokens, total + logprob, "stop"))
                else:
                    candidates.append((tokens + [token], total + logprob))
        live = sorted(candidates, key=lambda c: -c[1])[:width]
        if not live:
            break
    beams = ended + [(tokens, total, "length") for tokens, total in live]
    return sorted(beams, key=lambda b: b[1] / (len(prompt_ids) + len(b[0])) ** length_penalty, reverse=True)[:width]


@pytest.mark.parametrize("width,max_tokens,length_penalty", [(4, 5, 1.0), (2, 6, 0.0), (3, 4, 2.0)])
async def test_beams_equal_a_reference_search(cluster, unified_url, width, max_tokens, length_penalty):
    ids = (await answer(cluster, unified_url, {"prompt": PROMPT}, "/tokenize"))["tokens"]
    expected = await reference_beams(cluster, unified_url, ids, width, max_tokens, length_penalty)
    got = await answer(cluster, unified_url, {**BEAMS, "n": width, "max_tokens": max_tokens,
                                              "length_penalty": length_penalty})
    choices = got["choices"]
    assert [c["index"] for c in choices] == list(range(width))
    assert [(c["token_ids"], c["finish_reason"]) for c in choices] == [(t, reason) for t, _, reason in expected]
    for choice, (tokens, total, reason) in zip(choices, expected):
        logprobs = choice["logprobs"]["token_logprobs"]
        assert len(logprobs) == len(tokens)
        if reason == "length":
            assert sum(logprobs) == pytest.approx(total, abs=1e-4)
    assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": sum(len(t) for t, _, _ in expected),
                            "total_tokens": len(ids) + sum(len(t) for t, _, _ in expected),
                            "prompt_tokens_details": {"cached_tokens": (len(ids) - 1) // 4 * 4}}  # the reference's blocks


async def test_beams_through_pd_equal_unifieds_and_move_one_prompt(cluster, unified_url, router_url):
    beams = {**BEAMS, "prompt": "A fresh prompt for the beams"}
    unified = await answer(cluster, unified_url, beams)
    before = await cluster.decode_kv_bytes()
    pd = await answer(cluster, router_url, beams)
    beam_bytes = await cluster.decode_kv_bytes() - before
    assert [(c["token_ids"], c["text"], c["finish_reason"]) for c in pd["choices"]] == \
        [(c["token_ids"], c["text"], c["finish_reason"]) for c in unified["choices"]]
    for a, b in zip(pd["choices"], unified["choices"]):
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-4)
    # Only step 0's KV crossed (as much as one plain request of a fresh prompt of the same length):
    # the later steps ran on the decode over the prompt's blocks it received.
    plain = await answer(cluster, router_url, {"model": "tiny", "prompt": "B fresh prompt for the beams", "max_tokens": 1})
    assert plain["usage"]["prompt_tokens"] == pd["usage"]["prompt_tokens"]
    assert beam_bytes > 0 and await cluster.decode_kv_bytes() - before == 2 * beam_bytes
    assert await cluster.settled(((96, 96), (96, 96))) == ([96, 96], [96, 96])


async def test_logprobs_past_the_candidates_are_answered(cluster, unified_url):
    # One beam takes 2 candidates a step; the 5 top logprobs asked for come with each token anyway.
    got = await answer(cluster, unified_url, {**BEAMS, "n": 1, "logprobs": 5, "return_tokens_as_token_ids": True})
    [choice] = got["choices"]
    assert [len(top) for top in choice["logprobs"]["top_logprobs"]] == [5] * len(choice["token_ids"])
    greedy = await answer(cluster, unified_url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                 "return_token_ids": True, "ignore_eos": True})
    assert choice["token_ids"] == greedy["choices"][0]["token_ids"][:len(choice["token_ids"])]


async def test_beams_in_the_pull_flow_equal_unifieds(cluster, unified_url):
    router = RouterServer(RouterConfig(port=0, protocol="pull", health_check_interval_s=0, decode=(cluster.decode_url,),
                                       prefill=(PrefillEndpoint(cluster.prefill_url, None),)))
    await router.start()
    try:
        beams = {**BEAMS, "prompt": "Pulled beams, and a longer prompt"}
        unified = await answer(cluster, unified_url, beams)
        pulled = await answer(cluster, router.url, beams)
    finally:
        await router.close()
    assert [(c["token_ids"], c["text"]) for c in pulled["choices"]] == \
        [(c["token_ids"], c["text"]) for c in unified["choices"]]
    assert await cluster.settled(((96, 96), (96, 96))) == ([96, 96], [96, 96])


async def test_streamed_and_chat_beams_through_pd(cluster, unified_url, router_url):
    whole = await answer(cluster, router_url, BEAMS)
    status, text, _ = await cluster.post(router_url + "/v1/completions", {**BEAMS, "stream": True,
                                                                          "stream_options": {"include_usage": True}}, None)
    assert status == 200
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    texts = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: what the cache held before
    assert [events[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
    assert text.rstrip().endswith("data: [DONE]")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "use_beam_search": True, "n": 3,
            "max_tokens": 4, "return_token_ids": True}
    unified = await answer(cluster, unified_url, chat, "/v1/chat/completions")
    pd = await answer(cluster, router_url, chat, "/v1/chat/completions")
    assert [(c["index"], c["token_ids"], c["message"]["content"]) for c in pd["choices"]] == \
        [(c["index"], c["token_ids"], c["message"]["content"]) for c in unified["choices"]]
    assert [c["message"]["role"] for c in pd["choices"]] == ["assistant"] * 3


async def test_n_choices_for_each_prompt_of_a_list(cluster, unified_url, router_url):
    sampled = {"model": "tiny", "max_tokens": 4, "temperature": 1.0, "seed": 11, "ignore_eos": True, "n": 2,
               "return_token_ids": True}
    singles = [(await answer(cluster, unified_url, {**sampled, "prompt": p}))["choices"] for p in ("ab", "cd e")]
    for url in (unified_url, router_url):
        batch = await answer(cluster, url, {**sampled, "prompt": ["ab", "cd e"]})
        # Choice p * n + i is prompt p's choice i, seeded seed + i as a single request's is.
        assert [(c["index"], c["token_ids"]) for c in batch["choices"]] == \
            [(2 * p + i, singles[p][i]["token_ids"]) for p in range(2) for i in range(2)]
        assert batch["usage"]["prompt_tokens"] == 3 + 5  # each prompt once (BOS + its bytes)
        assert batch["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("body,param,message", [
    ({"stop": ["x"]}, "stop", "stop does not apply to beam search: use_beam_search takes n, max_tokens, "
     "length_penalty, ignore_eos, include_stop_str_in_output, temperature and logprobs"),
    ({"n": 11}, "n", "use_beam_search takes n (the beam width) between 1 and 10, got 11: each beam asks for "
     "2 x n logprobs a step, at most 20"),
    ({"echo": True}, "echo", "echo does not apply to beam search"),
    ({"response_format": {"type": "json_object"}}, "response_format",
     "response_format does not apply to beam search: use_beam_search takes n, max_tokens, length_penalty, "
     "ignore_eos, include_stop_str_in_output, temperature and logprobs"),
    ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty", "length_penalty applies only with use_beam_search"),
    ({"max_tokens": 4000}, "max_tokens", "This model's maximum context length is 512 tokens. However, you requested "
     "4006 tokens (6 in the messages, 4000 in the completion). Please reduce the length of the messages or completion."),
])
async def test_what_beam_search_refuses(cluster, unified_url, router_url, body, param, message):
    for url in (unified_url, router_url):
        status, data, _ = await cluster.post(url + "/v1/completions", {**BEAMS, "prompt": "hello", **body}, None)
        assert (status, data["error"]["param"], data["error"]["message"]) == (400, param, message)


async def test_tools_are_refused_with_beam_search(cluster, unified_url):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    status, data, _ = await cluster.post(unified_url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "tools": tools, "tool_choice": "required"}, None)
    assert (status, data["error"]["message"]) == (400, "tools do not apply to beam search")
