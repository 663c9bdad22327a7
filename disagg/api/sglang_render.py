"""SGLang /generate answers: `{text, output_ids, meta_info}`, cumulative in every streamed event,
with SGLang's logprob fields: `(logprob, token_id, text or null)` triples."""

from __future__ import annotations

from dataclasses import dataclass

from disagg.api.generation import TokenLogprobs, Totals
from disagg.types import FinishReason
from disagg.wire.engine_msgs import OutputMsg


def finish_reason_info(totals: Totals) -> dict | None:
    """SGLang's `meta_info.finish_reason`: `{"type": "stop", "matched": ...}`, length or abort."""
    reason = totals.finish_reason
    if reason is None:
        return None
    if reason == FinishReason.STOP:
        return {"type": "stop"} if totals.stop_reason is None else {"type": "stop", "matched": totals.stop_reason}
    if reason == FinishReason.LENGTH:
        return {"type": "length", "length": totals.num_output_tokens}
    return {"type": "abort", "message": "the request was aborted"}


@dataclass(frozen=True)
class LogprobFields:
    """What one prompt asked for: `return_logprob`, `logprob_start_len` (-1: output only),
    `top_logprobs_num`, `token_ids_logprob` and `return_text_in_logprobs`."""

    return_logprob: bool = False
    start: int = -1
    top_n: int = 0
    token_ids: tuple[int, ...] = ()
    return_text: bool = False


class SGLangRenderer:
    """Bodies of /generate for one prompt."""

    def __init__(self, fields: LogprobFields):
        self.fields = fields

    def chunks(self, out: OutputMsg, totals: Totals) -> list[object]:
        if not out.new_token_ids and out.finish_reason is None:
            return []
        return [self.full(totals)]

    def tail(self, totals: Totals) -> list[object]:
        return []

    def full(self, totals: Totals) -> object:
        meta = {
            "id": totals.request_id, "finish_reason": finish_reason_info(totals),
            "prompt_tokens": totals.num_prompt_tokens, "completion_tokens": totals.num_output_tokens,
            "cached_tokens": totals.num_cached_tokens, "dp_rank": totals.dp_rank,
            "e2e_latency": totals.e2e_latency_s,
        }
        if self.fields.return_logprob:
            meta.update(self._logprobs(totals))
        return {"text": totals.text, "output_ids": list(totals.token_ids), "meta_info": meta}

    def _triples(self, entries: list[tuple[int, float]], totals: Totals) -> list[list]:
        texts = totals.token_texts if self.fields.return_text else {}
        return [[lp, token_id, texts.get(token_id)] for token_id, lp in entries]

    def _split(self, entry: TokenLogprobs) -> tuple[list, list, list]:
        """(the token's pair, the top-n, the token_ids_logprob pairs) of one position."""
        num_ids = len(self.fields.token_ids)
        return entry[:1], entry[1:len(entry) - num_ids], entry[len(entry) - num_ids:]

    def _logprobs(self, totals: Totals) -> dict:
        f = self.fields
        parts = [self._split(e) for e in totals.logprobs or []]
        found = {"output_token_logprobs": [self._triples(token, totals)[0] for token, _, _ in parts]}
        if f.top_n:
            found["output_top_logprobs"] = [self._triples(top, totals) for _, top, _ in parts]
        if f.token_ids:
            found["output_token_ids_logprobs"] = [self._triples(ids, totals) for _, _, ids in parts]
        if f.start >= 0:
            found.update(self._input_logprobs(totals))
        return found

    def _input_logprobs(self, totals: Totals) -> dict:
        f = self.fields
        ids = totals.prompt_token_ids or []
        tokens, tops, by_id = [], [], []
        for i, entry in enumerate((totals.prompt_logprobs or [])[f.start:], start=f.start):
            if entry is None:  # the first prompt token: nothing predicts it
                known_id = ids[i] if i < len(ids) else None
                tokens.append([None, known_id, totals.token_texts.get(known_id) if f.return_text else None])
                tops.append(None)
                by_id.append(None)
                continue
            token, top, asked = self._split(entry)
            tokens.append(self._triples(token, totals)[0])
            tops.append(self._triples(top, totals))
            by_id.append(self._triples(asked, totals))
        found = {"input_token_logprobs": tokens}
        if f.top_n:
            found["input_top_logprobs"] = tops
        if f.token_ids:
            found["input_token_ids_logprobs"] = by_id
        return found


class SGLangBatchRenderer:
    """A batch's bodies: the list of every item's answer; streamed, each event is one item's
    cumulative answer with its `index` (as SGLang streams batches)."""

    def __init__(self, renderers: list[SGLangRenderer]):
        self.renderers = renderers

    def chunks(self, index: int, out: OutputMsg, totals: Totals) -> list[object]:
        return [{**chunk, "index": index} for chunk in self.renderers[index].chunks(out, totals)]

    def tail(self, totals: list[Totals]) -> list[object]:
        return []

    def full(self, totals: list[Totals]) -> object:
        return [r.full(t) for r, t in zip(self.renderers, totals)]
