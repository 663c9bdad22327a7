"""Structured output: grammars compiled and matched by llguidance, the one place it is imported.

Why llguidance and not xgrammar: docs/api.md ("Structured output"). A request's matcher is kept by
the sampler and synced with the request's output before every sampled token, so it advances with
every accepted token wherever that token came from: this engine's last step, or the first token a
remote prefill sampled (P/D), or tokens recomputed after a preemption.
"""

from __future__ import annotations

from collections import OrderedDict

from functools import cached_property
from types import ModuleType

import torch

from disagg.engine.tokenizer import Tokenizer
from disagg.types import GrammarKind, InvalidRequest, StructuredOutput

_FORMATS = {GrammarKind.REGEX: "regex", GrammarKind.GRAMMAR: "grammar",
            GrammarKind.CHOICE: "choice"}
_BITS = torch.arange(32, dtype=torch.int32)


def _llguidance() -> ModuleType:
    try:
        import llguidance
    except ImportError as exc:  # a dependency of the package: only a broken install lacks it
        raise RuntimeError("structured output needs the llguidance package: pip install 'llguidance>=1,<2'") from exc
    return llguidance


class GrammarError(RuntimeError):
    """A matcher refused a token or entered its error state (fails that request only)."""


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, advanced by the accepted ones."""

    def __init__(self, matcher: object, vocab_size: int):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self.num_consumed = 0

    def sync(self, output_token_ids: tuple[int, ...]) -> None:
        """Consume the output tokens this matcher has not seen yet."""
        for token_id in output_token_ids[self.num_consumed:]:
            if not self._matcher.consume_token(token_id):
                raise GrammarError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")
            self.num_consumed += 1

    def allowed(self) -> torch.Tensor:
        """A bool [vocab] tensor: True where the grammar allows the token next."""
        words = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar failed: {self._matcher.get_error()}")
        bits = (words[:, None] >> _BITS) & 1
        return bits.flatten()[: self._vocab_size].bool()


GRAMMAR_CACHE_SIZE = 64  # distinct grammars kept compiled per worker


class GrammarCompiler:
    """Turns a request's StructuredOutput into llguidance grammars and matchers for one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's rows (may exceed the tokenizer's entries)
        # Admission, a role's check and the first sample all need the grammar: compile it once.
        self._grammars: OrderedDict[StructuredOutput, str] = OrderedDict()

    @cached_property
    def _lltokenizer(self) -> object:
        # Built on first use (~0.4 s for a 49k vocabulary); the tokenizers JSON is all it needs.
        eos = list(self.tokenizer.eos_token_ids) or None
        return _llguidance().LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)

    def grammar(self, structured: StructuredOutput) -> str:
        """The llguidance grammar of `structured` (cached); InvalidRequest (naming its field) when invalid."""
        if structured in self._grammars:
            self._grammars.move_to_end(structured)
            return self._grammars[structured]
        grammar = self._compile(structured)
        self._grammars[structured] = grammar
        if len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def _compile(self, structured: StructuredOutput) -> str:
        llg = _llguidance()
        try:
            if structured.kind is GrammarKind.JSON_SCHEMA:
                # Compact separators, no free whitespace: what vLLM's disable_any_whitespace gives; a
                # weak model otherwise fills the output with newlines.
                grammar = llg.LLMatcher.grammar_from_json_schema(structured.spec, defaults={"whitespace_flexible": False})
            else:
                grammar = llg.grammar_from(_FORMATS[structured.kind], structured.spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"invalid {structured.kind}: {exc}", structured.param) from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self._lltokenizer)
        if is_error:
            raise InvalidRequest(f"invalid {structured.kind}: {messages[0]}", structured.param)
        return grammar

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of the output."""
        matcher = _llguidance().LLMatcher(self._lltokenizer, self.grammar(structured), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar failed: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)
