"""The router's side of selective disaggregation, pure: the answer text it learns from a decode's
chat or completions response (whole or streamed), and the refusal that sends a request again with
a prefill."""

import json

from disagg.router.errors import ServerError
from disagg.router.local_prefill import answer_text, learned_text, refuses_local_prefill


def sse(*events) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_the_answer_of_a_chat_or_a_completion_whole_or_streamed():
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris is."}}]}
    assert answer_text("/v1/chat/completions", json.dumps(chat).encode(), stream=False) == "Paris is."
    streamed = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                   {"choices": [{"index": 0, "delta": {"content": "Par"}}]},
                   {"choices": [{"index": 0, "delta": {"content": "is."}, "finish_reason": "length"}]},
                   {"choices": [], "usage": {"prompt_tokens": 9}})
    assert answer_text("/v1/chat/completions", streamed, stream=True) == "Paris."
    completion = sse({"choices": [{"index": 0, "text": " blue"}]}, {"choices": [{"index": 0, "text": " sky"}]})
    assert answer_text("/v1/completions", completion, stream=True) == " blue sky"
    assert learned_text("/v1/completions", "The", completion, stream=True) == "The blue sky"
    assert learned_text("/v1/chat/completions", "You help. Capital of France?", streamed, stream=True) == (
        "You help. Capital of France? Paris.")


def test_nothing_is_learned_from_what_no_next_turn_continues():
    two = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]}  # n = 2
    assert answer_text("/v1/completions", json.dumps(two).encode(), stream=False) is None
    assert answer_text("/v1/completions", sse({"choices": [{"index": 1, "text": "b"}]}), stream=True) is None
    assert answer_text("/generate", b'{"text": "x"}', stream=False) is None  # not a route with an answer to learn
    assert answer_text("/v1/completions", b"data: {not json\n\n", stream=True) is None
    assert learned_text("/v1/completions", (1, 2, 3), b'{"choices": [{"text": "x"}]}', stream=False) is None  # ids
    assert learned_text("/v1/completions", "p", b'{"choices": [{"text": ""}]}', stream=False) is None  # no answer


def test_only_a_decodes_400_with_the_local_prefill_code_sends_the_request_again_with_a_prefill():
    body = json.dumps({"error": {"message": "...", "type": "BadRequestError", "param": "bootstrap_room",
                                 "code": "local_prefill_refused"}})
    refusal = ServerError("decode", "http://d", 400, body.encode(), "application/json")
    assert refuses_local_prefill(refusal)
    other = json.dumps({"error": {"message": "...", "param": "max_tokens"}}).encode()
    assert not refuses_local_prefill(ServerError("decode", "http://d", 400, other, "application/json"))
    # the field's name is no signal: only the code is
    uncoded = json.dumps({"error": {"message": "...", "param": "bootstrap_room", "code": None}}).encode()
    assert not refuses_local_prefill(ServerError("decode", "http://d", 400, uncoded, "application/json"))
    assert not refuses_local_prefill(ServerError("prefill", "http://p", 400, body.encode(), "application/json"))
    assert not refuses_local_prefill(ServerError("decode", "http://d", 503, body.encode(), "application/json"))
