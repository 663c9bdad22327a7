"""Tool calling without a server: the request checks (vLLM's texts), the schema of `required` and named
choices, the history's tool fields, and the calls read from text, whole and streamed piece by piece."""

import json
import os
import random
import re

import msgspec
import pytest

from disagg.api.tool_calls import ArrayItems, ToolStream, ValueScanner, choice_finish_reason, whole_message
from disagg.api.tools import AUTO_NEEDS_FLAGS, CORRECT_USAGE, plan_tools, template_fields, tool_constraint
from disagg.http_edge import BadRequest
from disagg.tool_config import ToolConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time",
                                          "parameters": {"type": "object", "properties": {"tz": {"$ref": "#/$defs/tz"}},
                                                         "$defs": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}}}}
TOOLS = [WEATHER, TIME]
PARSING = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
PLAIN = ToolConfig()
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def refused(tools, choice, config=PARSING) -> tuple[str, str]:
    with pytest.raises(BadRequest) as err:
        plan_tools(tools, choice, None, config)
    return err.value.message, err.value.param


def test_tool_choice_defaults_and_modes():
    assert plan_tools(TOOLS, msgspec.UNSET, None, PARSING).mode == "auto"
    assert plan_tools(TOOLS, None, None, PARSING).mode == "auto"
    assert plan_tools(TOOLS, None, None, PLAIN).mode == "none"  # null skips the checks, as vLLM's
    assert plan_tools(TOOLS, "required", False, PLAIN).parallel is False
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, PLAIN)
    assert (named.mode, named.name, named.parser) == ("named", "get_time", None)
    assert plan_tools(TOOLS, "none", None, PLAIN).template_tools == TOOLS
    assert plan_tools(TOOLS, "none", None, ToolConfig(exclude_tools_when_tool_choice_none=True)).template_tools is None
    assert plan_tools(None, msgspec.UNSET, None, PLAIN) is None
    assert plan_tools([], "required", None, PLAIN) is None  # OpenAI's: no tools, nothing required
    assert plan_tools(None, "none", None, PLAIN) is None


def test_tool_request_errors_are_vllms():
    assert refused(TOOLS, msgspec.UNSET, PLAIN) == (AUTO_NEEDS_FLAGS, "tool_choice")
    assert refused(TOOLS, "auto", PLAIN) == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set', "tool_choice")
    assert refused(None, "required") == ("When using `tool_choice`, `tools` must be set.", "tool_choice")
    assert refused(TOOLS, "sometimes") == (
        'Invalid value for `tool_choice`: sometimes! Only named tools, "none", "auto" or "required" are supported.',
        "tool_choice")
    assert refused(TOOLS, {"type": "function"})[0] == f"Invalid value for `function`: `None` in `tool_choice`! {CORRECT_USAGE}"
    assert refused(TOOLS, {"function": {}})[0] == f"Expected field `name` in `function` in `tool_choice`! {CORRECT_USAGE}"
    assert refused(TOOLS, {"function": {"name": ""}})[0] == f"Invalid `name` in `function`: `` in `tool_choice`! {CORRECT_USAGE}"
    assert refused(TOOLS, {"function": {"name": "get_news"}}) == (
        "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice")
    assert refused([{"type": "function", "function": {"name": 3}}], "none") == (
        "tools[0].function.name must be a non-empty string", "tools")
    assert refused("get_weather", "none")[1] == "tools"


def test_required_schema_has_one_alternative_per_tool_and_hoists_defs():
    constraint = tool_constraint(plan_tools(TOOLS, "required", None, PLAIN))
    assert (constraint.kind, constraint.param) == ("json_schema", "tool_choice")
    weather_params = WEATHER["function"]["parameters"]
    assert json.loads(constraint.spec) == {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": weather_params},
             "required": ["name", "parameters"], "additionalProperties": False},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {"type": "object", "properties": {"tz": {"$ref": "#/$defs/tz"}}}},
             "required": ["name", "parameters"], "additionalProperties": False}]},
        "$defs": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}}
    assert "$defs" in TIME["function"]["parameters"]  # the request's own tools are left as they came
    named = tool_constraint(plan_tools(TOOLS, {"function": {"name": "get_weather"}}, None, PLAIN))
    assert json.loads(named.spec) == weather_params
    assert tool_constraint(plan_tools(TOOLS, "auto", None, PARSING)) is None
    clash = [TIME, {"type": "function", "function": {"name": "t2", "parameters": {"$defs": {"tz": {"type": "integer"}}}}}]
    with pytest.raises(BadRequest, match="Tool definition 'tz' has multiple schemas, which is not supported."):
        tool_constraint(plan_tools(clash, "required", None, PLAIN))


def test_history_tool_fields_reach_the_template_with_parsed_arguments():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert template_fields({"role": "assistant", "tool_calls": [call]}, 1) == {"tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    empty = {**call, "function": {"name": "get_time", "arguments": ""}}
    assert template_fields({"role": "assistant", "tool_calls": [empty]}, 1)["tool_calls"][0]["function"]["arguments"] == {}
    assert template_fields({"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22"}, 2) == {
        "tool_call_id": "call_1", "name": "get_weather"}
    bad = {**call, "function": {"name": "get_weather", "arguments": "{city"}}
    with pytest.raises(BadRequest) as err:
        template_fields({"role": "assistant", "tool_calls": [bad]}, 3)
    assert err.value.message == ("messages[3].tool_calls[0].function.arguments is not valid JSON: Expecting property "
                                 "name enclosed in double quotes: line 1 column 2 (char 1)")


HERMES_TEXT = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"}ris"}}\n</tool_call>\n'
               '<tool_call>{"name":"get_time","arguments":{"tz":"CET"}}</tool_call>')


def test_hermes_whole_text_gives_content_and_each_call():
    plan = plan_tools(TOOLS, "auto", None, PARSING)
    content, calls = whole_message(plan, HERMES_TEXT)
    assert content == "Let me check."
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Pa\\"}ris"}'},
                                              {"name": "get_time", "arguments": '{"tz": "CET"}'}]
    assert all(CALL_ID.fullmatch(c["id"]) and c["type"] == "function" for c in calls)
    assert len(whole_message(plan_tools(TOOLS, "auto", False, PARSING), HERMES_TEXT)[1]) == 1
    assert whole_message(plan, "<tool_call>{nope}</tool_call>") == ("<tool_call>{nope}</tool_call>", [])
    assert whole_message(plan, "  <tool_call>" + HERMES_TEXT.split("<tool_call>")[2])[0] is None
    assert whole_message(plan, "No tools needed.") == ("No tools needed.", [])
    assert choice_finish_reason(plan, True, "length") == "tool_calls"
    assert choice_finish_reason(plan, False, "stop") == "stop"
    assert choice_finish_reason(plan, True, None) is None  # still running: a streamed chunk says nothing


def stream(plan, text: str, seed: int = 0) -> tuple[str, list[dict]]:
    """Feed `text` in pieces of 1 to 4 characters, as tokens arrive."""
    tool_stream, rng, at, content, deltas = ToolStream(plan), random.Random(seed), 0, "", []
    while at < len(text):
        size = rng.randint(1, 4)
        piece, at = text[at:at + size], at + size
        more, new = tool_stream.feed(piece, at >= len(text))
        content, deltas = content + more, deltas + new
    return content, deltas


def joined(deltas: list[dict]) -> list[tuple[str, str]]:
    """Each call's (name, arguments joined) in index order; every header carries an id."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert CALL_ID.fullmatch(d["id"]) and d["type"] == "function" and d["function"]["arguments"] == ""
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("seed", range(4))
def test_hermes_streams_content_then_each_calls_own_argument_text(seed):
    content, deltas = stream(plan_tools(TOOLS, "auto", None, PARSING), HERMES_TEXT, seed)
    assert content == "Let me check."
    assert joined(deltas) == [("get_weather", '{"city": "Pa\\"}ris"}'), ("get_time", '{"tz":"CET"}')]
    only_first = stream(plan_tools(TOOLS, "auto", False, PARSING), HERMES_TEXT, seed)[1]
    assert {d["index"] for d in only_first} == {0}
    assert joined(only_first) == [("get_weather", '{"city": "Pa\\"}ris"}')]


def test_hermes_stream_holds_back_only_what_may_begin_a_tag():
    plan = plan_tools(TOOLS, "auto", None, PARSING)
    tool_stream = ToolStream(plan)
    assert tool_stream.feed("a <tool", False) == ("a ", [])
    assert tool_stream.feed("s>", False) == ("<tools>", [])
    assert tool_stream.feed(" <", True) == (" <", [])  # the end: nothing is held back


def test_required_and_named_stream_and_whole():
    text = '[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", "parameters": {"city": "]{"}}]'
    required = plan_tools(TOOLS, "required", None, PLAIN)
    assert [c["function"] for c in whole_message(required, text)[1]] == [
        {"name": "get_time", "arguments": '{"tz": "UTC"}'}, {"name": "get_weather", "arguments": '{"city": "]{"}'}]
    assert whole_message(required, text)[0] == ""
    content, deltas = stream(required, text)
    assert content == ""
    assert joined(deltas) == [("get_time", '{"tz": "UTC"}'), ("get_weather", '{"city": "]{"}')]
    assert whole_message(required, text[:30]) == (text[:30], [])  # cut by max_tokens: the text stays
    content, calls = whole_message(required, text[:-3])  # the first object complete
    assert (content, [c["function"] for c in calls]) == ("", [{"name": "get_time", "arguments": '{"tz": "UTC"}'}])
    one = json.loads(tool_constraint(plan_tools(TOOLS, "required", False, PLAIN)).spec)
    assert (one["minItems"], one["maxItems"]) == (1, 1)
    assert choice_finish_reason(required, True, "stop") == "tool_calls"
    assert choice_finish_reason(required, True, "length") == "length"
    named = plan_tools(TOOLS, {"function": {"name": "get_weather"}}, None, PLAIN)
    content, calls = whole_message(named, '{"city": "Rome"}')
    assert (content, [c["function"] for c in calls]) == ("", [{"name": "get_weather", "arguments": '{"city": "Rome"}'}])
    assert joined(stream(named, '{"city": "Rome"}')[1]) == [("get_weather", '{"city": "Rome"}')]
    assert choice_finish_reason(named, True, "stop") == "stop"


def test_a_streamed_array_is_scanned_once_and_gives_each_object_so_far(monkeypatch):
    text = '[{"name": "a", "parameters": {"s": "}{"}}, {"name": "b", "parameters": {}}]'
    items, steps = ArrayItems(), []
    step = ArrayItems._step
    monkeypatch.setattr(ArrayItems, "_step", lambda self, ch, at: (steps.append(at), step(self, ch, at)))
    first = '{"name": "a", "parameters": {"s": "}{"}}'
    seen = [items.feed(text[:n]) for n in (5, 40, 41, len(text))]
    assert seen == [['{"na'], [first[:-1]], [first], [first, '{"name": "b", "parameters": {}}']]
    assert steps == list(range(len(text)))  # every character once over the four feeds


@pytest.mark.parametrize("value, end", [('{"a": "}"} tail', 10), ('["x", {"y": [1]}],', 17), ('"s\\"}" ,', 6),
                                        ("12.5}", 4), ("true,", 4), ('{"a": 1', None)])
def test_value_scanner_finds_where_a_value_ends(value, end):
    scanner = ValueScanner()
    for at in range(len(value)):
        scanner.feed(value[:at + 1])
    assert scanner.end == end


def test_the_repositorys_hermes_template_renders_tools_calls_and_answers():
    from disagg.engine.loader import read_chat_template
    from disagg.engine.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = read_chat_template(os.path.join(ROOT, "deploy/templates/tool_chat_template_hermes.jinja"))
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "22 C", "tool_call_id": "c1"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert tokenizer.apply_chat_template(messages, True, {"tools": tools}) == (
        "<|im_start|>system\nYou may call one or more functions to assist with the user query. The functions are "
        "listed within <tools></tools>:\n<tools>\n"
        '{"name": "get_weather", "parameters": {"type": "object"}}\n</tools>\n'
        "To call a function, answer with its name and arguments as a JSON object within <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(messages[:1], True) == "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_template_flag_names_a_file_or_is_a_template():
    from disagg.config import ConfigError
    from disagg.engine.loader import read_chat_template

    assert read_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ConfigError, match="chat template 'templates/none.jinja' names no file and is not a Jinja template"):
        read_chat_template("templates/none.jinja")
    with pytest.raises(ConfigError, match="does not compile"):
        read_chat_template("{% for m in messages %}")
