"""Structured-output request fields → one StructuredOutput (kind, spec, the field it came from).

OpenAI/vLLM: `response_format` (`text`, `json_object`, `json_schema`) and vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`). SGLang: the sampling
params `json_schema`, `regex`, `ebnf`. At most one constraint per request, as upstream; anything
else they offer (structural tags, whitespace patterns, backend choices) is a 400 naming it. The
grammar itself is checked by the worker (disagg/engine/grammar.py), which answers 400 too.
"""

from __future__ import annotations

import json

from disagg.http_edge import BadRequest
from disagg.types import GrammarKind, StructuredOutput

JSON_OBJECT = '{"type": "object"}'
_SO_KEYS = {"json": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX, "choice": GrammarKind.CHOICE,
            "grammar": GrammarKind.GRAMMAR}
_SO_NEUTRAL = {"json_object": (None, False), "disable_fallback": (None, False), "disable_any_whitespace": (None, False),
               "disable_additional_properties": (None, False), "whitespace_pattern": (None,), "structural_tag": (None,),
               "_backend": (None,), "_backend_was_auto": (None, False)}


def from_openai(response_format: object, structured_outputs: object,
                guided: dict[str, object] | None = None) -> StructuredOutput | None:
    """The constraint of an OpenAI/vLLM body (completions, chat, and vLLM's tokens endpoint).
    `guided` holds vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
    (by their structured_outputs key), read as that `structured_outputs`."""
    legacy = {k: v for k, v in (guided or {}).items() if v is not None}
    if legacy and structured_outputs is not None:
        raise BadRequest("set structured_outputs or the guided_* fields, not both", "structured_outputs")
    found = [c for c in (_response_format(response_format), _structured_outputs(structured_outputs or legacy or None))
             if c is not None]
    if len(found) > 1:
        raise BadRequest("set one of response_format and structured_outputs, not both", "structured_outputs")
    return found[0] if found else None


def from_sglang(json_schema: str | None, regex: str | None, ebnf: str | None) -> StructuredOutput | None:
    """SGLang's sampling params: at most one of `json_schema`, `regex`, `ebnf`."""
    given = [(name, value) for name, value in (("json_schema", json_schema), ("regex", regex), ("ebnf", ebnf))
             if value is not None]
    if len(given) > 1:
        raise BadRequest("Only one of regex, json_schema, or ebnf can be set.", given[1][0])
    if not given:
        return None
    name, value = given[0]
    kind = {"json_schema": GrammarKind.JSON_SCHEMA, "regex": GrammarKind.REGEX, "ebnf": GrammarKind.GRAMMAR}[name]
    return StructuredOutput(kind, value, name)


def _response_format(value: object) -> StructuredOutput | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(GrammarKind.JSON_SCHEMA, JSON_OBJECT, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format json_schema needs json_schema.schema (a JSON schema object)",
                             "response_format")
        return StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(schema), "response_format")
    raise BadRequest(f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
                     "response_format")


def _structured_outputs(value: object) -> StructuredOutput | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest("structured_outputs must be an object", "structured_outputs")
    for key, item in value.items():
        if key not in _SO_KEYS and key not in _SO_NEUTRAL:
            raise BadRequest(f"structured_outputs.{key} is not a known field", "structured_outputs")
        if key in _SO_NEUTRAL and key != "json_object" and item not in _SO_NEUTRAL[key]:
            raise BadRequest(f"structured_outputs.{key} is not supported", "structured_outputs")
    found = [(k, v) for k, v in value.items() if k in _SO_KEYS and v is not None]
    if value.get("json_object"):
        found.append(("json_object", JSON_OBJECT))
    if len(found) > 1:
        raise BadRequest("You can only use one kind of constraints for structured outputs "
                         "('json', 'regex', 'choice', 'grammar' or 'json_object').", "structured_outputs")
    if not found:
        return None
    key, spec = found[0]
    if key == "json_object":
        return StructuredOutput(GrammarKind.JSON_SCHEMA, spec, "structured_outputs")
    return StructuredOutput(_SO_KEYS[key], _spec_text(key, spec), "structured_outputs")


def _spec_text(key: str, spec: object) -> str:
    """The spec as text: a schema may come as an object or as JSON text; choices as a list of strings."""
    if key == "json":
        return spec if isinstance(spec, str) else json.dumps(spec)
    if key == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
            raise BadRequest("structured_outputs.choice must be a non-empty list of strings", "structured_outputs")
        return json.dumps(spec)
    if not isinstance(spec, str):
        raise BadRequest(f"structured_outputs.{key} must be a string", "structured_outputs")
    return spec
