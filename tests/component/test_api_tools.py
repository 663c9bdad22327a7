"""Tool calling at the front door (a fake engine): what reaches the worker (the tools as a template
variable, the history's calls with parsed arguments, the schema of a required choice, the special
tokens kept for the hermes parser) and the 400s, over real HTTP."""

import json

import pytest
from fake_engine import FakeEngine, api_client

from disagg.tool_config import ToolConfig

pytestmark = pytest.mark.asyncio
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
PARSING = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "2 + 2?"}], "max_tokens": 2, "tools": [TOOL], **fields}


async def sent(body: dict, tools: ToolConfig = PARSING):
    """(status, answer, the GenerateMsg the worker got or None)."""
    engine = FakeEngine()
    async with api_client(engine, tools=tools) as client:
        resp = await client.post("/v1/chat/completions", json=body)
        answer = await resp.json()
    return resp.status, answer, engine.requests[0][0] if engine.requests else None


async def test_auto_keeps_special_tokens_and_hands_the_tools_to_the_template():
    status, answer, msg = await sent(chat(chat_template_kwargs={"enable_thinking": False}))
    assert status == 200
    assert msg.chat_template_kwargs == {"tools": [TOOL], "enable_thinking": False}
    assert (msg.sampling.skip_special_tokens, msg.sampling.structured_output) == (False, None)
    # The fake engine writes " w100 w101": no call in it, so the text stays content.
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": " w100 w101", "tool_calls": []}
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_required_is_generated_under_the_array_schema():
    status, _, msg = await sent(chat(tool_choice="required", parallel_tool_calls=False), ToolConfig())
    assert status == 200
    assert (msg.sampling.structured_output.kind, msg.sampling.structured_output.param) == ("json_schema", "tool_choice")
    assert json.loads(msg.sampling.structured_output.spec) == {
        "type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["add"]}, "parameters": TOOL["function"]["parameters"]},
             "required": ["name", "parameters"], "additionalProperties": False}]}}
    assert msg.sampling.skip_special_tokens is True


async def test_none_answers_text_and_the_server_may_leave_the_tools_out():
    status, answer, msg = await sent(chat(tool_choice="none"), ToolConfig(exclude_tools_when_tool_choice_none=True))
    assert (status, msg.chat_template_kwargs, answer["choices"][0]["message"]) == (
        200, None, {"role": "assistant", "content": " w100 w101", "tool_calls": []})


async def test_the_history_call_reaches_the_template_with_parsed_arguments():
    history = [{"role": "user", "content": "2 + 2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_7", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_7", "content": "4"}]
    status, _, msg = await sent(chat(messages=history, tool_choice="none"))
    assert status == 200
    assert msg.messages == [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_7", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
        {"role": "tool", "content": "4", "tool_call_id": "call_7"}]


@pytest.mark.parametrize("body, tools, message, param", [
    (chat(), ToolConfig(), '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
     "tool_choice"),
    (chat(tool_choice="required", response_format={"type": "json_object"}), PARSING,
     "tool_choice 'required' writes its own JSON schema: leave response_format and structured_outputs unset",
     "tool_choice"),
    (chat(tool_choice={"type": "function", "function": {"name": "sub"}}), PARSING,
     "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"),
    (chat(tools=None, tool_choice="required"), PARSING, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{"}}]}]), PARSING,
     "messages[0].tool_calls[0].function.arguments is not valid JSON: Expecting property name enclosed in double "
     "quotes: line 1 column 2 (char 1)", "messages"),
    (chat(parallel_tool_calls="yes"), PARSING,
     "invalid request body: Expected `bool | null`, got `str` - at `$.parallel_tool_calls`",
     "parallel_tool_calls"),
])
async def test_bad_tool_requests_are_400s_and_reach_no_worker(body, tools, message, param):
    status, answer, msg = await sent(body, tools)
    assert (status, msg) == (400, None)
    assert (answer["error"]["message"], answer["error"]["param"]) == (message, param)


async def test_completions_still_refuse_tools():
    engine = FakeEngine()
    async with api_client(engine, tools=PARSING) as client:
        resp = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "tools": [TOOL]})
        answer = await resp.json()
    assert (resp.status, answer["error"]["param"]) == (400, "tools")
    assert answer["error"]["message"].startswith("tools is not supported by this server")
