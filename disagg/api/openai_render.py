"""OpenAI response bodies for /v1/completions and /v1/chat/completions, streamed and whole.

The front door has no tokenizer, so logprob tokens are written as `token_id:<id>` (vLLM's
`return_tokens_as_token_ids` form). Every body carries the serving worker's `dp_rank`.
"""

from __future__ import annotations

from disagg.api.generation import TokenLogprobs, Totals
from disagg.wire.engine_msgs import OutputMsg


def token_label(token_id: int) -> str:
    """How a token appears in logprobs without a tokenizer."""
    return f"token_id:{token_id}"


def completion_logprobs(entries: list[TokenLogprobs], text_offset: int) -> dict:
    """Legacy completions logprobs; each token's offset is where its chunk's text starts."""
    return {
        "tokens": [token_label(e[0][0]) for e in entries],
        "token_logprobs": [e[0][1] for e in entries],
        "top_logprobs": [{token_label(t): lp for t, lp in e[1:]} for e in entries],
        "text_offset": [text_offset] * len(entries),
    }


def _chat_token(token_id: int, logprob: float) -> dict:
    return {"token": token_label(token_id), "logprob": logprob, "bytes": None}


def chat_logprobs(entries: list[TokenLogprobs]) -> dict:
    """Chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    return {"content": [
        {**_chat_token(*e[0]), "top_logprobs": [_chat_token(t, lp) for t, lp in e[1:]]} for e in entries
    ]}


class _OpenAIRenderer:
    """What both OpenAI endpoints share: ids, usage chunks, `dp_rank`."""

    object_name = ""  # of the whole response
    chunk_object = ""  # of each streamed chunk

    def __init__(self, model: str, include_usage: bool, continuous_usage: bool):
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage

    def _envelope(self, totals: Totals, object_name: str, choices: list[dict]) -> dict:
        return {"id": totals.request_id, "object": object_name, "created": totals.created,
                "model": self.model, "choices": choices, "dp_rank": totals.dp_rank}

    def _chunk(self, totals: Totals, choice: dict) -> dict:
        chunk = self._envelope(totals, self.chunk_object, [choice])
        if self.continuous_usage:
            chunk["usage"] = totals.usage()
        return chunk

    def tail(self, totals: Totals) -> list[object]:
        """The final `choices: []` usage chunk when `stream_options.include_usage`."""
        if not self.include_usage:
            return []
        return [{**self._envelope(totals, self.chunk_object, []), "usage": totals.usage()}]


class CompletionRenderer(_OpenAIRenderer):
    """Bodies of /v1/completions."""

    object_name = "text_completion"
    chunk_object = "text_completion"

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        if not out.new_token_ids and out.finish_reason is None:
            return []
        offset = len(totals.text) - len(out.new_text)
        logprobs = completion_logprobs(out.logprobs, offset) if out.logprobs is not None else None
        return [self._chunk(totals, self._choice(out.new_text, logprobs, out.finish_reason, out.stop_reason))]

    def full(self, totals: Totals) -> object:
        logprobs = completion_logprobs(totals.logprobs, 0) if totals.logprobs is not None else None
        choice = self._choice(totals.text, logprobs, totals.finish_reason, totals.stop_reason)
        return {**self._envelope(totals, self.object_name, [choice]), "usage": totals.usage(),
                "kv_transfer_params": totals.kv_transfer_params}

    @staticmethod
    def _choice(text: str, logprobs: dict | None, finish_reason: str | None, stop_reason) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}


class ChatRenderer(_OpenAIRenderer):
    """Bodies of /v1/chat/completions; the first streamed chunk announces the assistant role."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool, continuous_usage: bool):
        super().__init__(model, include_usage, continuous_usage)
        self._sent_role = False

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        chunks: list[object] = []
        if not self._sent_role:
            self._sent_role = True
            chunks.append(self._chunk(totals, self._choice({"role": "assistant", "content": ""}, None, None, None)))
        if out.new_token_ids or out.finish_reason is not None:
            logprobs = chat_logprobs(out.logprobs) if out.logprobs is not None else None
            delta = {"content": out.new_text} if out.new_text or out.new_token_ids else {}
            chunks.append(self._chunk(totals, self._choice(delta, logprobs, out.finish_reason, out.stop_reason)))
        return chunks

    def full(self, totals: Totals) -> object:
        logprobs = chat_logprobs(totals.logprobs) if totals.logprobs is not None else None
        message = {"role": "assistant", "content": totals.text}
        choice = self._choice(message, logprobs, totals.finish_reason, totals.stop_reason, key="message")
        return {**self._envelope(totals, self.object_name, [choice]), "usage": totals.usage(),
                "kv_transfer_params": totals.kv_transfer_params}

    @staticmethod
    def _choice(body: dict, logprobs: dict | None, finish_reason: str | None, stop_reason,
                key: str = "delta") -> dict:
        return {"index": 0, key: body, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}
