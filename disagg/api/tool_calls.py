"""Tool calling, the output side: tool calls read from the generated text, whole and as streamed
deltas in OpenAI's shape (vLLM's rules; the request side is disagg/api/tools.py).

- auto, hermes parser: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as many as come.
  Whole: the content is the text before the first call (None when only whitespace), each call's
  arguments `json.dumps`'d; text that does not parse leaves no call and the whole text as content.
- required: the text is a JSON array of {name, parameters} (cut short: the objects it completed);
  named: the text is the arguments.
- Streamed: a call's first delta carries its id, type and name with `arguments: ""` (as OpenAI
  streams), then the model's own argument text as it arrives; content streams until the first
  `<tool_call>` (a tail that may begin one is held back).
- `parallel_tool_calls: false` keeps the first call only. finish_reason is "tool_calls" when auto
  found a call, or required ended on "stop"; a named call keeps the engine's reason.
"""

from __future__ import annotations

import json
import re
import uuid

from disagg.api.tools import AUTO, NAMED, REQUIRED, ToolPlan

START, END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def new_call_id() -> str:
    """vLLM's tool call id: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def choice_finish_reason(plan: ToolPlan, called: bool, engine_reason: str | None) -> str | None:
    """The choice's finish_reason once tool calls were (or were not) read from it; None while it runs."""
    if engine_reason is None:
        return None
    if called and (plan.mode == AUTO or plan.mode == REQUIRED and engine_reason == "stop"):
        return "tool_calls"
    return engine_reason


def whole_message(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """The message's content and tool calls for the whole generated `text`."""
    if plan.mode == NAMED:
        calls, content = [_call(plan.name or "", text)], ""
    elif plan.mode == REQUIRED:
        calls = _required(text)
        content = "" if calls else text  # no whole call (cut short): the text is kept
    elif plan.mode == AUTO:
        content, calls = _hermes(text)
    else:
        return text, []
    return content, calls if plan.parallel else calls[:1]


def _required(text: str) -> list[dict]:
    """The calls of a `required` array; cut short (max_tokens), the objects it completed."""
    items = []
    for item in ArrayItems().feed(text):
        try:
            items.append(json.loads(item))
        except json.JSONDecodeError:
            break
    return [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items
            if isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i]


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    if START not in text:
        return text, []
    try:
        found = [json.loads(closed or open_) for closed, open_ in _HERMES.findall(text)]
        calls = [_call(f["name"], json.dumps(f["arguments"], ensure_ascii=False)) for f in found]
    except (json.JSONDecodeError, KeyError, TypeError):
        return text, []  # vLLM's rule: one bad call and the text stays text
    content = text[:text.index(START)]
    return (content if content.strip() else None), calls


class ValueScanner:
    """Where a JSON value that arrives piece by piece ends: fed the text from the value's first
    character on, `end` becomes the index just past it (None while open). Strings and escapes are
    respected; a bare number or literal ends at the `,`, `}` or `]` after it."""

    def __init__(self) -> None:
        self.end: int | None = None
        self._at = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> int | None:
        while self.end is None and self._at < len(text):
            self._step(text[self._at], self._at)
            self._at += 1
        return self.end

    def _step(self, ch: str, at: int) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                self.end = at + 1 if self._depth == 0 else None
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]" and self._depth == 0 or ch == "," and self._depth == 0:
            self.end = at  # closes what holds a bare value: the value ended before it
        elif ch in "}]":
            self._depth -= 1
            self.end = at + 1 if self._depth == 0 else None


class CallStream:
    """One call's object (`{"name": ..., "<key>": value}`) arriving piece by piece: `feed` takes the
    whole object text so far and returns the deltas it adds (the first with id, type and name)."""

    def __init__(self, index: int, key: str):
        self.index = index
        self._key = re.compile(r'"%s"\s*:\s*(?=\S)' % key)  # once the value's first character is there
        self.named = False
        self._args_at: int | None = None
        self._sent = 0
        self._scanner = ValueScanner()

    def feed(self, text: str) -> list[dict]:
        deltas = []
        if not self.named:
            name = _NAME.search(text)
            if name is None:
                return []
            self.named = True
            deltas.append({"index": self.index, "id": new_call_id(), "type": "function",
                           "function": {"name": json.loads(f'"{name.group(1)}"'), "arguments": ""}})
        if self._args_at is None:
            key = self._key.search(text)
            if key is None:
                return deltas
            self._args_at = key.end()
        value = text[self._args_at:]
        end = self._scanner.feed(value)
        upto = len(value) if end is None else end
        if upto > self._sent:
            deltas.append({"index": self.index, "function": {"arguments": value[self._sent:upto]}})
            self._sent = upto
        return deltas


class ToolStream:
    """A streamed choice's tool calls: `feed(new_text, final)` returns (content delta, tool-call
    deltas) for the text generated so far."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.calls: list[CallStream] = []
        self._content_sent = 0
        self._items = ArrayItems()

    @property
    def called(self) -> bool:
        return any(c.named for c in self.calls)

    def feed(self, new_text: str, final: bool) -> tuple[str, list[dict]]:
        self.text += new_text
        if self.plan.mode == NAMED:
            deltas = self._named(new_text)
            content = ""
        elif self.plan.mode == REQUIRED:
            deltas = self._feed_calls(self._items.feed(self.text), "parameters")
            content = ""
        else:
            content = self._content(final)
            deltas = self._feed_calls(_hermes_bodies(self.text), "arguments")
        return content, [d for d in deltas if self.plan.parallel or d["index"] == 0]

    def _named(self, new_text: str) -> list[dict]:
        deltas = []
        if not self.calls:
            self.calls.append(CallStream(0, "arguments"))
            self.calls[0].named = True
            deltas.append({"index": 0, "id": new_call_id(), "type": "function",
                           "function": {"name": self.plan.name, "arguments": ""}})
        return deltas + ([{"index": 0, "function": {"arguments": new_text}}] if new_text else [])

    def _feed_calls(self, bodies: list[str], key: str) -> list[dict]:
        deltas = []
        for i, body in enumerate(bodies):
            if i == len(self.calls):
                self.calls.append(CallStream(i, key))
            deltas += self.calls[i].feed(body)
        return deltas

    def _content(self, final: bool) -> str:
        """Content before the first `<tool_call>`; a tail that may start one waits for more text."""
        cut = self.text.find(START)
        if cut < 0:
            cut = len(self.text) if final else len(self.text) - _partial_tag(self.text)
        piece = self.text[self._content_sent:cut]
        self._content_sent = max(self._content_sent, cut)
        return piece


def _partial_tag(text: str) -> int:
    """How many trailing characters of `text` could begin `<tool_call>`."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


def _hermes_bodies(text: str) -> list[str]:
    """Each `<tool_call>` region's text so far (up to its `</tool_call>`)."""
    bodies = []
    at = text.find(START)
    while at >= 0:
        begin = at + len(START)
        end = text.find(END, begin)
        bodies.append(text[begin:] if end < 0 else text[begin:end])
        at = -1 if end < 0 else text.find(START, end)
    return bodies


class ArrayItems:
    """The objects of a JSON array of objects arriving piece by piece: `feed(text)` takes the whole
    text so far and returns each object from its `{` to its end or the text's end. Each character
    is scanned once over the whole stream."""

    def __init__(self) -> None:
        self._done: list[tuple[int, int]] = []  # (start, end) of the closed objects
        self._start: int | None = None
        self._at = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> list[str]:
        while self._at < len(text):
            self._step(text[self._at], self._at)
            self._at += 1
        items = [text[a:b] for a, b in self._done]
        return items + ([text[self._start:]] if self._start is not None else [])

    def _step(self, ch: str, at: int) -> None:
        if self._in_string:
            self._escape, self._in_string = (False, True) if self._escape else (ch == "\\", ch != '"')
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2 and ch == "{":
                self._start = at
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1 and self._start is not None:
                self._done.append((self._start, at + 1))
                self._start = None
