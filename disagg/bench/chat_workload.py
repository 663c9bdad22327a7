"""The multi-turn chat workload of `disagg bench serve --workload chat`, as plain values.

Every conversation opens with one system prompt shared by all of them (a prefix the server can cache),
then alternates user messages and the model's answers; between turns the user thinks for an
exponential time. Now and then a turn carries a long document (a prefill burst). Everything comes
from `seed`: conversation i draws from its own RNG stream, so adding conversations leaves the earlier
ones as they were. Pure Python and numpy: no sockets, no asyncio.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from disagg.bench.text import words_text


@dataclass(frozen=True)
class ChatWorkloadConfig:
    """The shape of the conversations; token counts are targets for text built without a tokenizer."""

    num_conversations: int = 16
    turns_per_conversation: int = 4
    system_prompt_tokens: int = 256
    user_tokens: tuple[int, int] = (32, 128)  # inclusive range, uniform
    long_doc_prob: float = 0.0
    long_doc_tokens: int = 2048
    think_time_s: float = 1.0  # mean of the exponential pause before each turn after the first
    seed: int = 0

    def __post_init__(self):
        low, high = self.user_tokens
        if not 0 < low <= high:
            raise ValueError(f"user tokens: need 0 < MIN <= MAX, got {low} {high}")
        if not 0.0 <= self.long_doc_prob <= 1.0:
            raise ValueError(f"long-doc probability must be in [0, 1], got {self.long_doc_prob}")
        if self.num_conversations < 1 or self.turns_per_conversation < 1:
            raise ValueError("need at least one conversation of at least one turn")
        if self.think_time_s < 0 or self.system_prompt_tokens < 0 or self.long_doc_tokens < 0:
            raise ValueError("think time, system prompt tokens and long-doc tokens must be >= 0")


@dataclass(frozen=True)
class Turn:
    """One user message: its text, its token targets, and the pause before it is sent."""

    turn_index: int
    think_time_s: float  # 0 for the first turn
    num_user_tokens: int
    num_doc_tokens: int  # 0, or long_doc_tokens when this turn carries a document
    text: str


@dataclass(frozen=True)
class Conversation:
    conversation_id: int
    turns: tuple[Turn, ...]


def system_prompt(config: ChatWorkloadConfig) -> str:
    """The system prompt every conversation shares."""
    rng = np.random.default_rng([config.seed, 2])
    return "You are a helpful assistant. " + words_text(rng, config.system_prompt_tokens)


def make_turn(rng: np.random.Generator, config: ChatWorkloadConfig, turn_index: int) -> Turn:
    """Draws, in this order: think time, user tokens, long-doc coin, document words, user words."""
    think_time_s = float(rng.exponential(config.think_time_s)) if turn_index and config.think_time_s else 0.0
    num_user_tokens = int(rng.integers(config.user_tokens[0], config.user_tokens[1] + 1))
    has_doc = bool(rng.random() < config.long_doc_prob)
    num_doc_tokens = config.long_doc_tokens if has_doc else 0
    doc = f"Read this document:\n{words_text(rng, num_doc_tokens)}\n\n" if has_doc else ""
    return Turn(turn_index, think_time_s, num_user_tokens, num_doc_tokens,
                doc + words_text(rng, num_user_tokens))


def make_conversations(config: ChatWorkloadConfig) -> list[Conversation]:
    """`num_conversations` conversations of `turns_per_conversation` turns, all from `config.seed`."""
    conversations = []
    for conversation_id in range(config.num_conversations):
        rng = np.random.default_rng([config.seed, 3, conversation_id])
        turns = tuple(make_turn(rng, config, i) for i in range(config.turns_per_conversation))
        conversations.append(Conversation(conversation_id, turns))
    return conversations


def chat_payload(model: str, messages: list[dict], output_len: int) -> dict:
    """The /v1/chat/completions body: exactly `output_len` greedy tokens, streamed, with a usage chunk."""
    return {"model": model, "messages": messages, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def chat_config(args: argparse.Namespace) -> ChatWorkloadConfig:
    """The workload's options; ValueError names a bad one."""
    return ChatWorkloadConfig(
        num_conversations=args.num_conversations, turns_per_conversation=args.turns_per_conversation,
        system_prompt_tokens=args.system_prompt_tokens, user_tokens=tuple(args.user_tokens),
        long_doc_prob=args.long_doc_prob, long_doc_tokens=args.long_doc_tokens, think_time_s=args.think_time_s,
        seed=args.seed)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `--workload chat`."""
    group = parser.add_argument_group("chat workload (--workload chat)")
    add = group.add_argument
    defaults = ChatWorkloadConfig()
    add("--num-conversations", type=int, default=defaults.num_conversations, help="conversations in the run")
    add("--turns-per-conversation", type=int, default=defaults.turns_per_conversation,
        help="user messages (and answers) per conversation")
    add("--system-prompt-tokens", type=int, default=defaults.system_prompt_tokens,
        help="tokens (about) of the system prompt every conversation shares")
    add("--user-tokens", type=int, nargs=2, default=list(defaults.user_tokens), metavar=("MIN", "MAX"),
        help="tokens (about) of each user message, uniform in [MIN, MAX]")
    add("--think-time-s", type=float, default=defaults.think_time_s,
        help="mean of the exponential pause before each turn after the first")
    add("--long-doc-prob", type=float, default=defaults.long_doc_prob,
        help="chance that a user message carries a long document (a prefill burst)")
    add("--long-doc-tokens", type=int, default=defaults.long_doc_tokens, help="tokens (about) of that document")
