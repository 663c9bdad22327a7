"""`disagg bench serve --workload chat`: the seeded conversations and the per-turn figures with exact
values, and the whole command against a fake streaming chat server on a real socket."""

from __future__ import annotations

import argparse
import json

import pytest
from aiohttp import web
from fake_openai import app_in_thread, models, stream_events

from disagg.bench import serve
from disagg.bench.chat_workload import ChatWorkloadConfig, make_conversations, system_prompt
from disagg.bench.serve_stats import RequestResult, per_turn
from disagg.bench.text import WORDS

# --- the conversations -------------------------------------------------------------------------------

CONFIG = ChatWorkloadConfig(num_conversations=2, turns_per_conversation=3, system_prompt_tokens=13,
                            user_tokens=(4, 9), long_doc_prob=0.3, long_doc_tokens=26, think_time_s=0.5, seed=5)


def test_conversations_are_seeded_turns_with_exact_counts_and_think_times():
    conversations = make_conversations(CONFIG)
    assert conversations == make_conversations(CONFIG)
    shape = [[(t.turn_index, t.num_user_tokens, t.num_doc_tokens) for t in c.turns] for c in conversations]
    assert shape == [[(0, 9, 26), (1, 8, 0), (2, 4, 0)], [(0, 5, 0), (1, 5, 0), (2, 5, 0)]]
    think = [[t.think_time_s for t in c.turns] for c in conversations]
    assert think == [[0.0, 2.174734717984129, 0.15038186899786876], [0.0, 0.20534342323032348, 0.1508636520708305]]
    first = conversations[0].turns[0].text
    assert first.startswith("Read this document:\nprices stone about river ")
    document, question = first.removeprefix("Read this document:\n").split("\n\n")
    assert (len(document.split()), len(question.split())) == (20, 6)  # 26 / 1.3 and 9 / 1.3 words
    assert conversations[1].turns[0].text == "near trade mill"
    assert all(w in WORDS for c in conversations for t in c.turns for w in t.text.split()
               if w not in ("Read", "this", "document:"))


def test_conversation_i_does_not_depend_on_how_many_follow():
    longer = make_conversations(ChatWorkloadConfig(**{**CONFIG.__dict__, "num_conversations": 5}))
    assert longer[:2] == make_conversations(CONFIG)
    assert make_conversations(ChatWorkloadConfig(**{**CONFIG.__dict__, "seed": 6}))[:2] != longer[:2]


def test_system_prompt_is_shared_and_seeded():
    assert system_prompt(CONFIG) == ("You are a helpful assistant. families where prices to runs news wool roads "
                                     "to river")


def test_long_doc_probability_bounds():
    every = make_conversations(ChatWorkloadConfig(num_conversations=3, long_doc_prob=1.0, long_doc_tokens=13))
    never = make_conversations(ChatWorkloadConfig(num_conversations=3, long_doc_prob=0.0))
    assert {t.num_doc_tokens for c in every for t in c.turns} == {13}
    assert {t.num_doc_tokens for c in never for t in c.turns} == {0}


@pytest.mark.parametrize("fields, message", [
    ({"user_tokens": (9, 4)}, "user tokens: need 0 < MIN <= MAX, got 9 4"),
    ({"long_doc_prob": 1.5}, "long-doc probability must be in [0, 1], got 1.5"),
    ({"turns_per_conversation": 0}, "need at least one conversation of at least one turn"),
])
def test_bad_config_is_a_value_error(fields, message):
    with pytest.raises(ValueError) as err:
        ChatWorkloadConfig(**fields)
    assert str(err.value) == message


def test_cli_options_and_aliases():
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://x", "--workload", "chat", "--user-tokens", "3", "6",
                              "--output-tokens", "7", "--goodput", "ttft:500"])
    assert (args.workload, args.user_tokens, args.output_len, args.slo.ttft_ms) == ("chat", [3, 6], 7, 500.0)
    assert (args.num_conversations, args.turns_per_conversation, args.think_time_s) == (16, 4, 1.0)
    assert parser.parse_args(["--base-url", "http://x"]).workload == "random"


# --- per-turn figures --------------------------------------------------------------------------------


def turn_result(turn_index: int, ttft_s: float, prompt: int, cached: int | None, ok: bool = True) -> RequestResult:
    return RequestResult(start_s=0.0, num_prompt_tokens=prompt, ok=ok, ttft_s=ttft_s if ok else None,
                         num_cached_tokens=cached, turn_index=turn_index)


def test_per_turn_percentiles_and_cached_share():
    results = [turn_result(0, 0.1, 100, 0), turn_result(0, 0.3, 100, 50), turn_result(1, 0.2, 200, 150),
               turn_result(1, 0.4, 300, None), turn_result(1, 0.6, 100, 100), turn_result(1, 9.0, 80, 80, ok=False),
               turn_result(2, 0.5, 400, None)]
    rows = per_turn(results)
    assert [pytest.approx(row) for row in rows] == [
        {"turn_index": 0, "num_requests": 2, "num_completed": 2, "ttft_p50_ms": 200.0, "ttft_p99_ms": 298.0,
         "num_prompt_tokens": 200, "num_cached_tokens": 50, "cached_share": 0.25},
        {"turn_index": 1, "num_requests": 4, "num_completed": 3, "ttft_p50_ms": 400.0, "ttft_p99_ms": 596.0,
         "num_prompt_tokens": 300, "num_cached_tokens": 250, "cached_share": 250 / 300},
        {"turn_index": 2, "num_requests": 1, "num_completed": 1, "ttft_p50_ms": 500.0, "ttft_p99_ms": 500.0,
         "num_prompt_tokens": 0, "num_cached_tokens": 0, "cached_share": None},
    ]
    assert per_turn([turn_result(None, 0.1, 4, None)]) == []  # the random workload has no turns


# --- the whole command against a fake chat server ----------------------------------------------------

RUN_CONFIG = ChatWorkloadConfig(num_conversations=3, turns_per_conversation=3, system_prompt_tokens=8,
                                user_tokens=(3, 6), think_time_s=0.01, seed=1)
CONVERSATIONS = make_conversations(RUN_CONFIG)
FAILING_TEXT = CONVERSATIONS[2].turns[1].text  # conversation 2 ends at its turn 1 with HTTP 503


def answer(turn_index: int) -> str:
    return f"Sure, turn {turn_index}"


def fake_chat_app(received: list[dict]) -> web.Application:
    """Streams the role chunk, `answer(turn)` in three content chunks, a finish chunk and usage of
    10 prompt tokens per message with all but the last two messages cached; 503 for FAILING_TEXT."""

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        received.append(body)
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        if users[-1] == FAILING_TEXT:
            return web.Response(status=503, text="busy")
        num_messages = len(body["messages"])
        num_cached = max(0, 10 * (num_messages - 2))
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
                  *({"choices": [{"index": 0, "delta": {"content": piece}}]}
                    for piece in ("Sure", ", ", f"turn {len(users) - 1}")),
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 10 * num_messages, "completion_tokens": 3,
                                            "prompt_tokens_details": {"cached_tokens": num_cached}}}]
        return await stream_events(request, events)

    app = web.Application()
    app.add_routes([web.post("/v1/chat/completions", chat), web.get("/v1/models", models)])
    return app


@pytest.fixture
def chat_server():
    """The fake chat app on 127.0.0.1, port 0, in its own thread; yields (base URL, received bodies)."""
    received: list[dict] = []
    with app_in_thread(fake_chat_app(received)) as base_url:
        yield base_url, received


def expected_messages(conversation_index: int, turn_index: int) -> list[dict]:
    messages = [{"role": "system", "content": system_prompt(RUN_CONFIG)}]
    for turn in CONVERSATIONS[conversation_index].turns[: turn_index + 1]:
        messages.append({"role": "user", "content": turn.text})
        if turn.turn_index < turn_index:
            messages.append({"role": "assistant", "content": answer(turn.turn_index)})
    return messages


@pytest.mark.timeout(30)
def test_chat_command_against_fake_server(chat_server, tmp_path, capsys):
    base_url, received = chat_server
    out = tmp_path / "r.json"
    rc = serve.main(["--base-url", base_url, "--workload", "chat", "--num-conversations", "3",
                     "--turns-per-conversation", "3", "--system-prompt-tokens", "8", "--user-tokens", "3", "6",
                     "--think-time-s", "0.01", "--output-tokens", "3", "--seed", "1", "--num-warmups", "1",
                     "--goodput", "ttft:10000", "--label", "chat", "--out", str(out)])
    assert rc == 0
    warmup, *run = received
    assert [m["role"] for m in warmup["messages"]] == ["user"]
    assert {k: v for k, v in run[0].items() if k != "messages"} == {
        "model": "fake-model", "max_tokens": 3, "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
    first_texts = [c.turns[0].text for c in CONVERSATIONS]
    sent = sorted((first_texts.index(b["messages"][1]["content"]), len(b["messages"]), b["messages"]) for b in run)
    assert [(c, n) for c, n, _ in sent] == [(0, 2), (0, 4), (0, 6), (1, 2), (1, 4), (1, 6), (2, 2), (2, 4)]
    assert [m for _, _, m in sent] == [expected_messages(c, (n - 2) // 2) for c, n, _ in sent]

    report = json.loads(out.read_text())
    assert (report["num_conversations"], report["num_conversations_completed"],
            report["num_turns_offered"]) == (3, 2, 9)
    assert (report["num_requests"], report["num_completed"], report["num_failed"]) == (8, 7, 1)
    assert (report["first_error"], report["num_good"], report["num_output_tokens"]) == ("HTTP 503: busy", 7, 21)
    assert report["num_prompt_tokens"] == 3 * 20 + 2 * 40 + 2 * 60
    assert [(r["turn_index"], r["num_requests"], r["num_completed"], r["num_prompt_tokens"], r["num_cached_tokens"])
            for r in report["per_turn"]] == [(0, 3, 3, 60, 0), (1, 3, 2, 80, 40), (2, 2, 2, 120, 80)]
    assert [r["cached_share"] for r in report["per_turn"]] == pytest.approx([0.0, 0.5, 2 / 3])
    assert all(r["ttft_p50_ms"] > 0 for r in report["per_turn"])
    assert report["config"]["workload"] == "chat" and report["config"]["user_tokens"] == [3, 6]
    summary = capsys.readouterr().out.splitlines()
    assert summary[0] == (f"== disagg bench serve: chat (fake-model at {base_url}, 3 conversations x 3 turns, "
                          f"3 out, rate inf conv/s) ==")
    assert "conversations completed:   2 of 3" in summary
    assert ("turns good / sent / offered: 7 / 8 / 9 (a failed turn ends its conversation: its later turns are not "
            "sent)") in summary
    turn_lines = [line for line in summary if line[:1] in "012" and line.endswith("%")]
    assert [(line.split()[:2], line.split()[-1]) for line in turn_lines] == [
        (["0", "3/3"], "0.0%"), (["1", "2/3"], "50.0%"), (["2", "2/2"], "66.7%")]
