"""Structured output on the tiny random model: every output parses and matches its grammar."""

import json
import re

import jsonschema
import pytest

from disagg.engine.grammar import GrammarMatcher
from disagg.types import GrammarKind, InvalidRequest, SamplingParams, StructuredOutput
from test_engine_tiny import engine, run
from engine_runs import run_requests

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
     "required": ["ok", "color", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "minItems": 1, "maxItems": 3},
]


def structured(kind, spec, param="response_format", **fields):
    fields = {"max_tokens": 96, "temperature": 0, **fields}
    return SamplingParams(**fields, structured_output=StructuredOutput(GrammarKind(kind), spec, param))


def texts(core, prompts, params):
    outs = run(core, prompts, params)
    assert all(o.outputs.finish_reason.value == "stop" for o in outs), [o.outputs.text for o in outs]
    return [o.outputs.text for o in outs]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_parse_and_validate(tiny_loaded, schema):
    core = engine(tiny_loaded)
    prompts = ["Hello, world", "Paged attention!", "a"]
    for text in texts(core, prompts, structured("json_schema", json.dumps(schema))):
        jsonschema.validate(json.loads(text), schema)
    seeded = structured("json_schema", json.dumps(schema), temperature=1.0, seed=7)
    first = texts(core, prompts, seeded)
    for text in first:
        jsonschema.validate(json.loads(text), schema)
    assert texts(core, prompts, seeded) == first  # seeded sampling under a grammar repeats


def test_json_object_with_a_logit_bias_towards_closing(tiny_loaded):
    core = engine(tiny_loaded)
    close = core.tokenizer.encode("}", add_special_tokens=False)[0]
    params = structured("json_schema", '{"type": "object"}', logit_bias={str(close): 50.0})
    assert texts(core, ["Hello, world", "a"], params) == ["{}", "{}"]


def test_regex_choice_and_ebnf(tiny_loaded):
    core = engine(tiny_loaded)
    prompts = ["Hello, world", "0123456789"]
    for text in texts(core, prompts, structured("regex", r"[a-c]{2,4}-\d{3}", "regex")):
        assert re.fullmatch(r"[a-c]{2,4}-\d{3}", text), text
    for text in texts(core, prompts, structured("choice", json.dumps(["yes", "no", "maybe"]), "structured_outputs")):
        assert text in ("yes", "no", "maybe")
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    for text in texts(core, prompts, structured("grammar", grammar, "ebnf", max_tokens=40)):
        assert re.fullmatch(r"\(\d(\+\d)*\)", text), text


def test_structured_and_free_requests_share_a_batch(tiny_loaded):
    core = engine(tiny_loaded)
    free = run(core, ["Hello, world"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs.token_ids
    schema = SCHEMAS[1]
    prompt = core.tokenizer.encode("Hello, world")
    shaped, plain = run_requests(core, [(prompt, structured("json_schema", json.dumps(schema))),
                                        (prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])
    jsonschema.validate(json.loads(shaped.outputs.text), schema)
    assert plain.outputs.token_ids == free
    assert core.runner.sampler.matchers == {}  # forgotten when the request ended


@pytest.mark.parametrize("kind, spec, param, message", [
    ("json_schema", "{not json", "response_format", "invalid json_schema: "),
    ("regex", "(", "regex", "invalid regex: "),
    ("grammar", "root ::= undefined_rule", "ebnf", "invalid grammar: "),
])
def test_invalid_grammars_are_refused_at_admission(tiny_loaded, kind, spec, param, message):
    core = engine(tiny_loaded)
    with pytest.raises(InvalidRequest) as info:
        core.add_request("x", [1, 2], structured(kind, spec, param))
    assert info.value.param == param and info.value.message.startswith(message)
    assert not core.has_unfinished()


def test_a_refused_token_fails_only_its_matcher(tiny_loaded):
    matcher = engine(tiny_loaded).grammars.matcher(StructuredOutput(GrammarKind.REGEX, "ab", "regex"))
    assert isinstance(matcher, GrammarMatcher)
    a, b = (engine(tiny_loaded).tokenizer.encode(c, add_special_tokens=False)[0] for c in "ab")
    matcher.sync((a,))
    assert matcher.allowed().nonzero().flatten().tolist() == [b]
    with pytest.raises(RuntimeError, match="the grammar refused token"):
        matcher.sync((a, a))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smollm2_fills_a_schema(smollm2_loaded):
    from disagg.engine_config import CacheConfig, EngineConfig, ModelConfig
    from disagg.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=ModelConfig(dtype="float32"), cache=CacheConfig(num_blocks=128)), smollm2_loaded)
    tokenizer = core.tokenizer
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a cat called Tom, aged 3, as JSON."}])
    schema = SCHEMAS[1]
    [out] = run(core, [tokenizer.encode(chat, add_special_tokens=False)], structured("json_schema", json.dumps(schema)))
    assert out.outputs.finish_reason.value == "stop"
    jsonschema.validate(json.loads(out.outputs.text), schema)
    assert json.loads(out.outputs.text)["name"] == "Tom"  # the real model follows the prompt inside the grammar
