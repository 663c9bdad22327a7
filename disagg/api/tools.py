"""Tool calling, the request side: `tools`, `tool_choice` and `parallel_tool_calls` checked as vLLM
checks them (its error texts), the constraint that makes a `required` or named choice valid JSON for
its schema by construction, and the history's tool messages as a chat template reads them.

`tool_choice` absent means "auto" when there are tools; "auto" needs `--enable-auto-tool-choice` and
`--tool-call-parser`; "required" and a named function need neither (the grammar engine writes them).
The tools reach the template as its `tools` variable, also under "none" unless the server excludes
them. The output side is disagg/api/tool_calls.py.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import msgspec

from disagg.http_edge import BadRequest
from disagg.tool_config import ToolConfig
from disagg.types import GrammarKind, StructuredOutput

NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"
CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asked of its tools: `mode` (none, auto, required, named), the tools as sent,
    the named function, whether several calls may come back, auto's parser and the tools the
    template sees (None: none)."""

    mode: str
    tools: tuple[dict, ...]
    name: str | None = None
    parallel: bool = True
    parser: str | None = None
    template_tools: list[dict] | None = None


def plan_tools(tools: object, tool_choice: object, parallel: bool | None, config: ToolConfig) -> ToolPlan | None:
    """The request's plan, or None when it has no tools (the answer is plain text, as before).
    `tool_choice` is UNSET when the body leaves it out."""
    listed = _checked_tools(tools)
    given = tool_choice is not msgspec.UNSET and tool_choice is not None
    if not listed:
        if given and tools is None and tool_choice != NONE:
            raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(tool_choice, dict):
            _named(tool_choice, listed)  # names no tool: the same 400 as with tools
        return None
    mode, name = _choice(tool_choice, listed, config)
    shown = None if mode == NONE and config.exclude_tools_when_tool_choice_none else [dict(t) for t in listed]
    return ToolPlan(mode, tuple(listed), name, parallel is not False,
                    config.tool_call_parser if mode == AUTO else None, shown)


def _checked_tools(tools: object) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of {type: 'function', function: {name, description, parameters}}",
                         "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise BadRequest(f"tools[{i}] must be {{type: 'function', function: {{name, description, parameters}}}}",
                             "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"tools[{i}].function.name must be a non-empty string", "tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return [{**t, "type": "function"} for t in tools]


def _choice(tool_choice: object, tools: list[dict], config: ToolConfig) -> tuple[str, str | None]:
    if tool_choice is msgspec.UNSET or tool_choice == AUTO:
        if not config.enable_auto_tool_choice:
            raise BadRequest(AUTO_NEEDS_FLAGS, "tool_choice")
        return AUTO, None
    if tool_choice is None:  # vLLM skips its checks: parsed when the server parses
        return (AUTO if config.enable_auto_tool_choice else NONE), None
    if tool_choice in (NONE, REQUIRED):
        return str(tool_choice), None
    if isinstance(tool_choice, dict):
        return NAMED, _named(tool_choice, tools)
    raise BadRequest(f'Invalid value for `tool_choice`: {tool_choice}! Only named tools, "none", "auto" or '
                     '"required" are supported.', "tool_choice")


def _named(tool_choice: dict, tools: list[dict]) -> str:
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"Invalid value for `function`: `{function}` in `tool_choice`! {CORRECT_USAGE}", "tool_choice")
    if "name" not in function:
        raise BadRequest(f"Expected field `name` in `function` in `tool_choice`! {CORRECT_USAGE}", "tool_choice")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise BadRequest(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {CORRECT_USAGE}", "tool_choice")
    if all(t["function"]["name"] != name for t in tools):
        raise BadRequest("The tool specified in `tool_choice` does not match any of the specified `tools`",
                         "tool_choice")
    return name


def tool_constraint(plan: ToolPlan) -> StructuredOutput | None:
    """The JSON schema a `required` or named choice is generated under (vLLM's): the named tool's
    parameters (none given: no constraint), or an array of at least one {name, parameters} object
    with one alternative per tool and every tool's `$defs` hoisted to the top. The alternatives
    allow no other keys, as vLLM's default grammar backend (strict) reads them; with
    `parallel_tool_calls: false` the array holds one call."""
    if plan.mode == NAMED:
        [params] = [t["function"].get("parameters") for t in plan.tools if t["function"]["name"] == plan.name][:1]
        return None if params is None else StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(params), "tool_choice")
    if plan.mode != REQUIRED:
        return None
    defs: dict[str, object] = {}
    choices = []
    for tool in plan.tools:
        params = copy.deepcopy(tool["function"].get("parameters")) or {"type": "object", "properties": {}}
        for def_name, schema in params.pop("$defs", {}).items():
            if def_name in defs and defs[def_name] != schema:
                raise BadRequest(f"Tool definition '{def_name}' has multiple schemas, which is not supported.",
                                 "tools")
            defs[def_name] = schema
        choices.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                       "parameters": params}, "required": ["name", "parameters"],
                        "additionalProperties": False})
    schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices}}
    if not plan.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(schema), "tool_choice")


def template_fields(message: dict, i: int) -> dict:
    """A history message's tool fields as chat templates read them: an assistant's `tool_calls`
    (each `function.arguments` parsed from its JSON text; empty: {}), a tool answer's
    `tool_call_id`, any message's `name`."""
    out: dict[str, object] = {}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    if message.get("role") == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and calls:
        if not isinstance(calls, list):
            raise BadRequest(f"messages[{i}].tool_calls must be a list", "messages")
        out["tool_calls"] = [_history_call(call, i, j) for j, call in enumerate(calls)]
    return out


def _history_call(call: object, i: int, j: int) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest(f"{where} must be {{id, type: 'function', function: {{name, arguments}}}}", "messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise BadRequest(f"{where}.function.arguments is not valid JSON: {exc}", "messages") from None
    elif not isinstance(arguments, (dict, list)):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}
