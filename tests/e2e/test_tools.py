"""Tool calling with the real openai SDK against real engine workers (tiny model, the repository's
hermes tool template): `disagg serve`'s cluster (our router, P/D on tcp) and a unified server, both
with `--enable-auto-tool-choice --tool-call-parser hermes`. Greedy, so P/D answers equal unified's:
required, named and auto calls, whole and streamed, and a tool loop's next turn carrying the call
and its result through the template."""

import json
from dataclasses import replace

import jsonschema
import openai
import pytest
import pytest_asyncio

from disagg.cluster import ClusterOptions, drain_cluster, start_cluster
from disagg.config import ServerConfig
from disagg.pd_config import DisaggConfig
from disagg.engine.loader import read_chat_template
from disagg.engine.models.tiny import build_tiny_tokenizer
from disagg.launch import start_server
from disagg.tool_config import ToolConfig
from pd_cluster import TINY, pd_config

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]
# The repository's template (deploy/templates) is too long for the tiny model's 512 tokens: this one
# names the tools and writes calls alike, briefly.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if tools and loop.first %}tools:"
            "{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
            " | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ENGINE = replace(TINY, model=replace(TINY.model, chat_template=TEMPLATE))
TOOLS_ON = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
                                                   "unit": {"type": "string", "enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time somewhere",
                                           "parameters": {"type": "object", "properties": {"tz": {"enum": ["CET", "JST"]}},
                                                          "required": ["tz"], "additionalProperties": False}}}]
MESSAGES = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Rome?"}]
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 120}
FORCED_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Tokyo)", "unit": "(c|f)"\}\}</tool_call>'


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def servers():
    """(P/D through our router, unified) openai clients."""
    prefill, decode, router = await start_cluster(ENGINE, pd_config("tcp"), ClusterOptions(
        port=0, servers=ServerConfig(dp_size=1, tools=TOOLS_ON)))
    unified = await start_server(ServerConfig(port=0, dp_size=1, tools=TOOLS_ON), ENGINE, DisaggConfig(), lambda _: None)
    clients = [openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
               for url in (router.url, f"http://127.0.0.1:{unified.port}")]
    yield clients
    for client in clients:
        await client.close()
    await unified.close()
    await drain_cluster(prefill, decode, router, 0)


def calls_of(response) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in response.choices[0].message.tool_calls]


async def streamed(client, **request) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(name, arguments joined)], finish_reason) of a streamed answer, checking each call's first delta."""
    content, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(stream=True, **request):
        assert finish is None  # a finish_reason comes on the last chunk only
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.id.startswith("chatcmpl-tool-") and delta.type == "function"
                calls[delta.index] = [delta.function.name, delta.function.arguments]
            else:
                assert delta.function.name is None
                calls[delta.index][1] += delta.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


async def test_required_call_is_valid_for_its_schema_and_pd_equals_unified(servers):
    answers = [await c.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, **GREEDY) for c in servers]
    assert [calls_of(a) for a in answers] == [[("get_weather", '{"city": "Rome", "unit": "c"}')]] * 2
    jsonschema.validate(json.loads(calls_of(answers[0])[0][1]), WEATHER_PARAMS)
    for answer in answers:
        choice = answer.choices[0]
        assert (choice.finish_reason, choice.message.content, choice.message.role) == ("tool_calls", "", "assistant")
        assert choice.message.tool_calls[0].id.startswith("chatcmpl-tool-")
    for client in servers:
        request = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **GREEDY)
        assert await streamed(client, **request) == ("", [("get_weather", '{"city":"Rome","unit":"c"}')], "tool_calls")


async def test_named_call_streams_its_arguments_and_keeps_the_engines_finish_reason(servers):
    named = {"type": "function", "function": {"name": "get_time"}}
    for client in servers:
        whole = await client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice=named, **GREEDY)
        assert calls_of(whole) == [("get_time", '{"tz":"JST"}')]
        assert (whole.choices[0].finish_reason, whole.choices[0].message.content) == ("stop", "")
        assert await streamed(client, messages=MESSAGES, tools=TOOLS, tool_choice=named, **GREEDY) == (
            "", [("get_time", '{"tz":"JST"}')], "stop")


async def test_auto_reads_hermes_calls_from_the_text(servers):
    request = dict(messages=MESSAGES, tools=TOOLS, extra_body={"structured_outputs": {"regex": FORCED_CALL}}, **GREEDY)
    for client in servers:
        whole = await client.chat.completions.create(**request)
        assert calls_of(whole) == [("get_weather", '{"city": "Paris", "unit": "f"}')]
        assert (whole.choices[0].finish_reason, whole.choices[0].message.content) == ("tool_calls", None)
        assert await streamed(client, **request) == ("", [("get_weather", '{"city": "Paris", "unit": "f"}')],
                                                     "tool_calls")
        plain = await client.chat.completions.create(messages=MESSAGES, tools=TOOLS, **{**GREEDY, "max_tokens": 6})
        assert (plain.choices[0].message.tool_calls, plain.choices[0].finish_reason) == ([], "length")


async def test_the_tool_loop_sends_the_call_and_its_result_through_the_template(servers):
    answers = []
    for client in servers:
        first = await client.chat.completions.create(messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                     parallel_tool_calls=False, **GREEDY)
        call = first.choices[0].message.tool_calls[0]
        history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "temp": 21}'}]
        answers.append(await client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none",
                                                            **{**GREEDY, "max_tokens": 8}))
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = read_chat_template(TEMPLATE)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}}
    rendered = tokenizer.apply_chat_template(
        [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "content": '{"sky": "sunny", "temp": 21}'}], True, {"tools": TOOLS})
    assert rendered == ('<|im_start|>system\ntools: get_weather get_time\nUse the tools.<|im_end|>\n'
                        '<|im_start|>user\nWeather in Rome?<|im_end|>\n<|im_start|>assistant\n<tool_call>'
                        '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}</tool_call><|im_end|>\n'
                        '<|im_start|>tool\n{"sky": "sunny", "temp": 21}<|im_end|>\n<|im_start|>assistant\n')
    assert [a.usage.prompt_tokens for a in answers] == [len(tokenizer.encode(rendered, add_special_tokens=False))] * 2
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert [a.choices[0].message.tool_calls for a in answers] == [[], []]
