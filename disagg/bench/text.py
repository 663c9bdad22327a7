"""Prompt text of about N tokens without a tokenizer: the bench runs against servers whose tokenizer
it may not have, so text is built from ordinary English words of a known average token count."""

from __future__ import annotations

import numpy as np

# Ordinary English words: about 1.3 tokens each in Llama-family vocabularies.
WORDS = ("the river runs past an old mill where people meet on market days to trade grain wool and news "
         "about weather roads prices and families while children play near stone bridges").split()
TOKENS_PER_WORD = 1.3


def num_words_for(num_tokens: int) -> int:
    """Words whose text is about `num_tokens` tokens long."""
    return int(num_tokens / TOKENS_PER_WORD)


def words_text(rng: np.random.Generator, num_tokens: int) -> str:
    """Random words from `rng`, about `num_tokens` tokens of text."""
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=num_words_for(num_tokens)))
