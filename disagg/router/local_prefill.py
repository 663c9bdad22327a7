"""Selective disaggregation at the router (`--max-local-prefill-tokens`): a decode's refusal to
prefill a request sent to it alone (the router then sends it with a prefill), and what a decode
answered, as the symbols of the router's decode tree: the decode holds a conversation's answers too,
so the router records each prompt with its answer there, and the next turn's rest is counted from
the end of that answer. Pure but for the learner, which writes the picker's tree.

Chat and completions only, one choice (the answer a next turn would carry): a chat's next prompt
joins the answer to the earlier messages with a space (`bodies.routing_text`), a completion's
continues it directly. Whole JSON answers and SSE streams alike; anything else learns nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from disagg.http_edge import HttpError
from disagg.types import ErrorCode
from disagg.router.bodies import CHAT_PATH, COMPLETIONS_PATH
from disagg.router.errors import ServerError
from disagg.router.legs import json_or_none
from disagg.router.policy import PairPolicy
from disagg.router.workers import Role

JOINERS = {CHAT_PATH: " ", COMPLETIONS_PATH: ""}
MAX_ANSWER_CHUNKS = 4096  # a stream of more reads is not kept for learning


def answer_text(path: str, raw: bytes, stream: bool) -> str | None:
    """The answer's text of one chat or completions response; None when there is none to learn."""
    if path not in JOINERS:
        return None
    try:
        if not stream:
            return _choice_text(path, msgspec.json.decode(raw), delta=False)
        pieces = []
        for line in raw.split(b"\n"):
            line = line.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = msgspec.json.decode(line[5:])
            if event.get("choices"):
                piece = _choice_text(path, event, delta=True)
                if piece is None:
                    return None
                pieces.append(piece)
        return "".join(pieces)
    except (msgspec.DecodeError, AttributeError, TypeError):
        return None


def _choice_text(path: str, answer: dict, delta: bool) -> str | None:
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or choices[0].get("index", 0) != 0:
        return None  # n > 1: no one answer continues the conversation
    choice = choices[0]
    if path == COMPLETIONS_PATH:
        text = choice.get("text")
    else:
        text = (choice.get("delta" if delta else "message") or {}).get("content")
    return text if isinstance(text, str) else ("" if delta else None)


def learned_text(path: str, prompt: object, raw: bytes, stream: bool) -> str | None:
    """The prompt and its answer as one routing text, or None."""
    answer = answer_text(path, raw, stream)
    if not answer or not isinstance(prompt, str) or not prompt:
        return None
    return prompt + JOINERS[path] + answer


def learner(picker: PairPolicy, path: str, prompt: object, decode_id: int, stream: bool) -> Callable[[bytes], None] | None:
    """What records a successful answer in the decode's tree; None when the picker keeps no decode
    trees or the route has no answer to learn."""
    if not picker.learns_answers or path not in JOINERS:
        return None

    def learn(raw: bytes) -> None:
        learned = learned_text(path, prompt, raw, stream)
        if learned is not None:
            picker.learn_answer(decode_id, learned)
    return learn


class LocalPrefillRefused(HttpError):
    """A decode sent a request alone would not prefill it (more of the prompt is uncached than its
    --max-local-prefill-tokens): the router sends it again with a prefill."""

    def __init__(self, refusal: ServerError):
        super().__init__(refusal.status, refusal.message)


def refuses_local_prefill(exc: ServerError) -> bool:
    """The decode's answer to a request sent alone that it would not prefill: a 400 with its ErrorCode."""
    if exc.role != str(Role.DECODE) or exc.status != 400:
        return False
    error = (json_or_none(exc.raw) or {}).get("error")
    return isinstance(error, dict) and error.get("code") == ErrorCode.LOCAL_PREFILL_REFUSED
