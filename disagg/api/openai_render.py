"""OpenAI response bodies for /v1/completions and /v1/chat/completions, streamed and whole.

The front door has no tokenizer: a request asking for logprobs has its worker send the text of
each token in them (`OutputMsg.token_texts`: the token decoded alone, as vLLM's
`convert_ids_list_to_tokens`), and the logprobs name tokens by it, with vLLM's `text_offset`
(completions) and `bytes` (chat). A token without one is written `token_id:<id>` (vLLM's
`return_tokens_as_token_ids` form). Every body carries the serving worker's `dp_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.api.generation import TokenLogprobs, Totals
from disagg.api.tool_calls import ToolStream, choice_finish_reason, whole_message
from disagg.api.tools import ToolPlan
from disagg.types import FinishReason
from disagg.wire.engine_msgs import OutputMsg


def token_label(token_id: int, texts: dict[int, str] | None = None) -> str:
    """How a token appears in logprobs: its text, or `token_id:<id>` when it has none."""
    text = None if texts is None else texts.get(token_id)
    return f"token_id:{token_id}" if text is None else text


def text_offsets(tokens: list[str], start: int) -> list[int]:
    """vLLM's `text_offset`: the first token at `start`, each next one the length of the one before further."""
    offsets, at = [], start
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return offsets


def completion_logprobs(entries: list[TokenLogprobs], text_offset: int, texts: dict[int, str] | None = None) -> dict:
    """Legacy completions logprobs; the first token's offset is where its chunk's text starts."""
    tokens = [token_label(e[0][0], texts) for e in entries]
    return {
        "tokens": tokens,
        "token_logprobs": [e[0][1] for e in entries],
        # The sampled token first, then the top-n (vLLM's dict: `logprobs: 0` still names the sampled one).
        "top_logprobs": [{token_label(t, texts): lp for t, lp in e} for e in entries],
        "text_offset": text_offsets(tokens, text_offset),
    }


def _chat_token(token_id: int, logprob: float, texts: dict[int, str] | None) -> dict:
    token = token_label(token_id, texts)  # `token_id:<id>` without its text, and its bytes those of that, as vLLM
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", errors="replace"))}


@dataclass(frozen=True)
class VllmExtras:
    """vLLM's answer fields beyond OpenAI's that a request asked for."""

    prompt_logprobs: bool = False  # `prompt_logprobs`: the prompt's top-n (else null, as vLLM sends it)
    token_ids: bool = False  # `return_token_ids`: `prompt_token_ids` and each choice's `token_ids`


def ranked_prompt_logprobs(totals: Totals, decoded: bool = True) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or `{"<id>": {"logprob", "rank",
    "decoded_token"}}`, the actual token first (its rank: the tokens at least as likely, itself included),
    then the top-n ranked 1 to n; the actual token among them keeps its place and takes their rank, as in
    vLLM. `decoded=False` leaves out `decoded_token` (the tokens route's answer)."""
    if totals.prompt_logprobs is None:
        return None
    ranks = totals.prompt_ranks or [None] * len(totals.prompt_logprobs)

    def entry(j: int, t: int, lp: float, rank: int | None) -> dict:
        out = {"logprob": lp, "rank": rank if j == 0 else j}
        return {**out, "decoded_token": token_label(t, totals.token_texts)} if decoded else out

    return [None if e is None else {str(t): entry(j, t, lp, rank) for j, (t, lp) in enumerate(e)}
            for e, rank in zip(totals.prompt_logprobs, ranks)]


def chat_logprobs(entries: list[TokenLogprobs], texts: dict[int, str] | None = None) -> dict:
    """Chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs}]}`."""
    return {"content": [
        {**_chat_token(*e[0], texts), "top_logprobs": [_chat_token(t, lp, texts) for t, lp in e[1:]]} for e in entries
    ]}


class _OpenAIRenderer:
    """What both OpenAI endpoints share: ids, usage chunks, `dp_rank`."""

    object_name = ""  # of the whole response
    chunk_object = ""  # of each streamed chunk

    def __init__(self, model: str, include_usage: bool, continuous_usage: bool, extras: VllmExtras = VllmExtras()):
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.extras = extras

    def _envelope(self, totals: Totals, object_name: str, choices: list[dict]) -> dict:
        return {"id": totals.request_id, "object": object_name, "created": totals.created,
                "model": self.model, "choices": choices, "dp_rank": totals.dp_rank}

    def _chunk(self, totals: Totals, choice: dict, num_unsent_tokens: int = 0) -> dict:
        """One streamed chunk; with continuous usage, the usage up to it (`num_unsent_tokens` of the
        totals' tokens come in later chunks)."""
        chunk = self._envelope(totals, self.chunk_object, [choice])
        if self.continuous_usage:
            usage = totals.usage()
            usage["completion_tokens"] -= num_unsent_tokens
            usage["total_tokens"] -= num_unsent_tokens
            chunk["usage"] = usage
        return chunk

    def tail(self, totals: Totals) -> list[object]:
        """The final `choices: []` usage chunk when `stream_options.include_usage`."""
        if not self.include_usage:
            return []
        return [{**self._envelope(totals, self.chunk_object, []), "usage": totals.usage()}]


class CompletionRenderer(_OpenAIRenderer):
    """Bodies of /v1/completions for one prompt (choice `index` of a batch). With `echo`, the text
    starts with the prompt (`prompt_text`, else the worker's detokenized prompt) and the logprobs
    with the prompt's (the first prompt token has none: null), as vLLM answers."""

    object_name = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, include_usage: bool, continuous_usage: bool, *, echo: bool = False,
                 prompt_text: str | None = None, index: int = 0, response_id: str | None = None,
                 extras: VllmExtras = VllmExtras()):
        super().__init__(model, include_usage, continuous_usage, extras)
        self.echo = echo
        self.prompt_text = prompt_text
        self.index = index
        self.response_id = response_id
        self._started = False

    def _envelope(self, totals: Totals, object_name: str, choices: list[dict]) -> dict:
        body = super()._envelope(totals, object_name, choices)
        return body if self.response_id is None else {**body, "id": self.response_id}

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        if not out.new_token_ids and out.finish_reason is None:
            return []
        echo_text = self._echo_text(totals) if self.echo else ""
        offset = len(echo_text) + len(totals.text) - len(out.new_text)
        logprobs = completion_logprobs(out.logprobs, offset, totals.token_texts) if out.logprobs is not None else None
        text, first = out.new_text, not self._started
        self._started = True
        if self.echo and first:
            text, logprobs = echo_text + text, self._with_prompt_logprobs(totals, logprobs)
        choice = self.choice(text, logprobs, out.finish_reason, out.stop_reason)
        if self.extras.token_ids:
            choice.update({"prompt_token_ids": totals.prompt_token_ids} if first else {}, token_ids=list(out.new_token_ids))
        return [self._chunk(totals, choice)]

    def full(self, totals: Totals) -> object:
        return {**self._envelope(totals, self.object_name, [self.full_choice(totals)]), "usage": totals.usage(),
                "kv_transfer_params": totals.kv_transfer_params}

    def full_choice(self, totals: Totals) -> dict:
        """The whole answer's choice."""
        echo_text = self._echo_text(totals) if self.echo else ""
        logprobs = (completion_logprobs(totals.logprobs, len(echo_text), totals.token_texts)
                    if totals.logprobs is not None else None)
        text = echo_text + totals.text
        if self.echo:
            logprobs = self._with_prompt_logprobs(totals, logprobs)
        choice = self.choice(text, logprobs, totals.finish_reason, totals.stop_reason)
        choice["prompt_logprobs"] = ranked_prompt_logprobs(totals) if self.extras.prompt_logprobs else None
        if self.extras.token_ids:
            choice.update(prompt_token_ids=totals.prompt_token_ids, token_ids=list(totals.token_ids))
        return choice

    def _echo_text(self, totals: Totals) -> str:
        return self.prompt_text if self.prompt_text is not None else totals.prompt_text or ""

    @staticmethod
    def _with_prompt_logprobs(totals: Totals, logprobs: dict | None) -> dict | None:
        if totals.prompt_logprobs is None:
            return logprobs
        prompt = prompt_completion_logprobs(totals.prompt_logprobs, totals.prompt_token_ids or [], totals.token_texts)
        return prompt if logprobs is None else {key: prompt[key] + logprobs[key] for key in prompt}

    def choice(self, text: str, logprobs: dict | None, finish_reason: FinishReason | None, stop_reason) -> dict:
        """One choice, at this prompt's index."""
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}


def prompt_completion_logprobs(entries: list[TokenLogprobs | None], prompt_token_ids: list[int],
                               texts: dict[int, str] | None = None) -> dict:
    """The prompt's logprobs in the legacy shape; a token without any (the first) has null ones."""
    ids = [prompt_token_ids[i] if e is None else e[0][0] for i, e in enumerate(entries)]
    tokens = [token_label(t, texts) for t in ids]
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e[0][1] for e in entries],
        "top_logprobs": [None if e is None else {token_label(t, texts): lp for t, lp in e} for e in entries],
        "text_offset": text_offsets(tokens, 0),
    }


class CompletionBatchRenderer:
    """/v1/completions with a list of prompts: `n` choices per prompt (choice `p * n + i`, its
    `index`), usage summed with each prompt counted once (vLLM's)."""

    def __init__(self, renderers: list[CompletionRenderer], n: int = 1):
        self.renderers, self.n = renderers, n

    def chunks(self, index: int, out: OutputMsg, totals: Totals) -> list[object]:
        return self.renderers[index].chunks(out, totals)

    def tail(self, totals: list[Totals]) -> list[object]:
        first = self.renderers[0]
        if not first.include_usage:
            return []
        return [{**first._envelope(totals[0], first.chunk_object, []), "usage": summed_usage(totals, self.n)}]

    def full(self, totals: list[Totals]) -> object:
        first = self.renderers[0]
        choices = [r.full_choice(t) for r, t in zip(self.renderers, totals)]
        return {**first._envelope(totals[0], first.object_name, choices), "usage": summed_usage(totals, self.n)}


def summed_usage(totals: list[Totals], n: int = 1) -> dict:
    """The usage of a batch of `n` choices per prompt: each prompt counted once, every choice's tokens."""
    prompts = totals[::n]
    num_prompt = sum(t.num_prompt_tokens for t in prompts)
    num_output = sum(t.num_output_tokens for t in totals)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": sum(t.num_cached_tokens for t in prompts)}}


class ChatRenderer(_OpenAIRenderer):
    """Bodies of /v1/chat/completions; the first streamed chunk announces the assistant role. With
    `tools` (a request's ToolPlan) the text is read for tool calls (disagg/api/tool_calls.py)."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool, continuous_usage: bool, tools: ToolPlan | None = None,
                 extras: VllmExtras = VllmExtras()):
        super().__init__(model, include_usage, continuous_usage, extras)
        self._sent_role = False
        self._tools = None if tools is None else ToolStream(tools)

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        chunks: list[object] = []
        if not self._sent_role:
            self._sent_role = True
            # Before any token, as vLLM's role chunk: its usage counts none of this output's tokens.
            chunks.append(self._chunk(totals, self._choice({"role": "assistant", "content": ""}, None, None, None),
                                      num_unsent_tokens=len(out.new_token_ids)))
            if self.extras.token_ids:
                chunks[0]["prompt_token_ids"] = totals.prompt_token_ids
        if out.new_token_ids or out.finish_reason is not None:
            logprobs = chat_logprobs(out.logprobs, totals.token_texts) if out.logprobs is not None else None
            delta, finish = self._delta(out)
            if delta or logprobs is not None or finish is not None:
                choice = self._choice(delta, logprobs, finish, out.stop_reason)
                if self.extras.token_ids:
                    choice["token_ids"] = list(out.new_token_ids)
                chunks.append(self._chunk(totals, choice))
        return chunks

    def _delta(self, out: OutputMsg) -> tuple[dict, FinishReason | str | None]:
        if self._tools is None:
            return ({"content": out.new_text} if out.new_text or out.new_token_ids else {}), out.finish_reason
        content, calls = self._tools.feed(out.new_text, out.finish_reason is not None)
        delta: dict[str, object] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta, choice_finish_reason(self._tools.plan, self._tools.called, out.finish_reason)

    def full(self, totals: Totals) -> object:
        logprobs = chat_logprobs(totals.logprobs, totals.token_texts) if totals.logprobs is not None else None
        message: dict[str, object] = {"role": "assistant", "content": totals.text}
        finish: FinishReason | str | None = totals.finish_reason
        if self._tools is not None:
            content, calls = whole_message(self._tools.plan, totals.text)
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            finish = choice_finish_reason(self._tools.plan, bool(calls), totals.finish_reason)
        choice = self._choice(message, logprobs, finish, totals.stop_reason, key="message")
        ids = {}
        if self.extras.token_ids:
            choice["token_ids"] = list(totals.token_ids)
            ids = {"prompt_token_ids": totals.prompt_token_ids}
        return {**self._envelope(totals, self.object_name, [choice]), "usage": totals.usage(),
                "prompt_logprobs": ranked_prompt_logprobs(totals) if self.extras.prompt_logprobs else None, **ids,
                "kv_transfer_params": totals.kv_transfer_params}

    @staticmethod
    def _choice(body: dict, logprobs: dict | None, finish: FinishReason | str | None, stop_reason,
                key: str = "delta") -> dict:
        return {"index": 0, key: body, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason}
