"""No field silently dropped: every field our chat and completions bodies accept either changes the
answer (a request with it set differs from the same request without it, on a real tiny engine) or is
in the short list of fields documented as accepted without effect here, each with why. A field of
neither kind fails the test, so a new body field has to be classified. Unknown fields follow vLLM's
extra="allow": the answer is the one without them."""

import json

import pytest

from disagg.api.bodies import ChatBody, CompletionBody
from disagg.api.upstream_fields import OPENAI_IGNORED

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
EOS, BOS = 257, 256  # the tiny model's
CHAT_BASE = {"messages": [{"role": "user", "content": "Hello there, friend"}], "max_tokens": 6, "temperature": 1.0,
             "seed": 7, "return_token_ids": True}
COMPLETION_BASE = {"prompt": "Hello there, friend", "max_tokens": 6, "temperature": 1.0, "seed": 7,
                   "return_token_ids": True}
GREEDY_LONG = {"temperature": 0, "max_tokens": 16}
FORCE_A = {"logit_bias": {"65": 100}}  # 'A' every step
FORCE_EOS = {"logit_bias": {str(EOS): 100}}
BEAMS = {"use_beam_search": True, "seed": None, "n": 10, "max_tokens": 8}  # a beam ended by EOS: lengths differ


def stop_inside(answer: dict) -> str:
    text = answer["choices"][0].get("text") or answer["choices"][0]["message"]["content"]
    return text[2:4]


# field -> (what it is set to, what the baseline adds so that the field matters). A callable value is
# computed from the baseline's answer.
SHARED = {
    "temperature": (0, {}), "top_p": (0.01, {}), "top_k": (1, {}), "min_p": (0.95, {}), "seed": (8, {}),
    "stop": (stop_inside, {}), "stop_token_ids": (lambda a: [a["choices"][0]["token_ids"][2]], {}),
    "ignore_eos": (True, FORCE_EOS), "min_tokens": (3, FORCE_EOS),
    "include_stop_str_in_output": (True, {"stop": "\x00", "temperature": 0, "max_tokens": 16, "allowed_token_ids": [0, 65]}),
    "skip_special_tokens": (False, {"logit_bias": {str(BOS): 100}}), "n": (2, {}),
    "presence_penalty": (2.0, GREEDY_LONG), "frequency_penalty": (2.0, GREEDY_LONG),
    "repetition_penalty": (1.9, GREEDY_LONG), "logit_bias": ({"65": 100}, {}), "allowed_token_ids": ([65, 66], {}),
    "bad_words": (["A"], FORCE_A), "truncate_prompt_tokens": (3, {}), "truncation_side": ("right", {"truncate_prompt_tokens": 3}),
    "response_format": ({"type": "json_object"}, {}), "structured_outputs": ({"regex": "[ab]+"}, {}),
    "guided_json": ({"type": "object"}, {}), "guided_regex": ("[ab]+", {}), "guided_choice": (["xyz", "uvw"], {}),
    "guided_grammar": ('root ::= "q"+', {}), "stream": (True, {}),
    "stream_options": ({"include_usage": True}, {"stream": True}), "max_tokens": (2, {}), "request_id": ("the-id", {}),
    "add_special_tokens": (True, {}), "prompt_logprobs": (1, {}), "return_token_ids": (False, {}),
    "return_tokens_as_token_ids": (True, {}),  # with the route's logprobs below
    "regex": ("[ab]+", {}), "ebnf": ('root ::= "z"+', {}), "json_schema": (json.dumps({"type": "object"}), {}),
    "use_beam_search": (True, {"seed": None}), "length_penalty": (8.0, BEAMS),
}
CHAT = {**SHARED, "messages": ([{"role": "user", "content": "Goodbye"}], {}), "max_completion_tokens": (2, {}),
        "logprobs": (True, {}), "top_logprobs": (3, {"logprobs": True}),
        "add_generation_prompt": (False, {}),
        "continue_final_message": (True, {"add_generation_prompt": False,
                                          "messages": CHAT_BASE["messages"] + [{"role": "assistant", "content": "Sure"}]}),
        # tools: the message carries `tool_calls` (the tiny model's template does not render them); with
        # the default tool_choice `auto` they need --enable-auto-tool-choice, else a 400
        "tools": ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                  {"tool_choice": "none"}),
        "tool_choice": ("required", {"tool_choice": "none", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]})}
CHAT["return_tokens_as_token_ids"] = (True, {"logprobs": True})
COMPLETIONS = {**SHARED, "prompt": ("Goodbye", {}), "logprobs": (1, {}), "echo": (True, {})}
COMPLETIONS["return_tokens_as_token_ids"] = (True, {"logprobs": 1})
COMPLETIONS["add_special_tokens"] = (False, {})  # the completions default adds BOS
# Accepted without effect on this model and server, and why (docs/api.md, "Upstream fields"):
NO_EFFECT = {
    "model": "checked: the served model's name (or none) answers as without it; another is a 404",
    "priority": "orders the queue only under --scheduling-policy priority",
    "chat_template_kwargs": "variables the model's chat template may read; the tiny model's reads none",
    "parallel_tool_calls": "false caps a turn at one call, which the tiny model's calls already are",
    "best_of": "1 only (another is a 400)", "suffix": "empty only (another is a 400)",
}


def normalized(status: int, content_type: str, raw: str, keep_id: bool) -> object:
    """The answer without what differs between any two requests (ids, times)."""
    if content_type.startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
        return status, [drop(e, keep_id) for e in events]
    return status, drop(json.loads(raw), keep_id)


def drop(body: dict, keep_id: bool) -> dict:
    out = {k: v for k, v in body.items() if k not in ("created", "dp_rank") and (keep_id or k != "id")}
    if isinstance(out.get("usage"), dict):  # what the prefix cache held depends on the requests before
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


async def ask(cluster, url: str, body: dict, keep_id: bool = False) -> object:
    async with cluster.session.post(url, json=body) as r:
        return normalized(r.status, r.content_type, await r.text(), keep_id)


@pytest.mark.parametrize("route, struct, base, table", [
    ("/v1/chat/completions", ChatBody, CHAT_BASE, CHAT),
    ("/v1/completions", CompletionBody, COMPLETION_BASE, COMPLETIONS),
], ids=["chat", "completions"])
async def test_every_field_changes_the_answer_or_is_documented(cluster, unified_url, route, struct, base, table):
    fields = set(struct.__struct_fields__)
    assert sorted(fields - set(table) - set(NO_EFFECT)) == []  # every field classified
    url = unified_url + route
    unchanged = []
    for field in sorted(fields & set(table)):
        value, extra = table[field]
        baseline_body = {**base, **extra}
        baseline = await ask(cluster, url, baseline_body, keep_id=field == "request_id")
        assert baseline[0] == 200, (field, baseline)
        if callable(value):
            value = value(baseline[1])
        changed = await ask(cluster, url, {**baseline_body, field: value}, keep_id=field == "request_id")
        assert changed[0] == 200, (field, changed)
        if changed == baseline:
            unchanged.append(field)
    assert unchanged == []
    for field in sorted(fields & set(NO_EFFECT) - {"best_of", "suffix", "parallel_tool_calls"}):
        added = {"model": {"model": "tiny"}, "priority": {"priority": 5},
                 "chat_template_kwargs": {"chat_template_kwargs": {"x": 1}}}[field]
        assert await ask(cluster, url, {**base, "temperature": 0, **added}) == \
            await ask(cluster, url, {**base, "temperature": 0}), field


async def test_unknown_fields_are_ignored_as_vllm_does(cluster, unified_url):
    for route, base in (("/v1/chat/completions", CHAT_BASE), ("/v1/completions", COMPLETION_BASE)):
        plain = await ask(cluster, unified_url + route, {**base, "temperature": 0})
        extra = await ask(cluster, unified_url + route, {**base, "temperature": 0, "no_such_field": {"x": 1},
                                                          sorted(OPENAI_IGNORED)[0]: "u"})
        assert extra == plain and plain[0] == 200
