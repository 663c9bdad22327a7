"""`disagg bench serve --workload chat`: multi-turn conversations on streaming `/v1/chat/completions`.

Conversations start as a Poisson process (`--request-rate` is conversations/s) and run side by side;
within one, each turn waits its think time, sends the whole history (the shared system prompt, every
earlier user message and the model's streamed answers) and appends this turn's answer. A failed turn
ends its conversation: the next turn has no answer to build on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable

import aiohttp
import numpy as np

from disagg.bench.chat_workload import Conversation, chat_config, chat_payload, make_conversations, system_prompt
from disagg.bench.serve import arrival_offsets_s, send_request
from disagg.bench.serve_stats import RequestResult, per_turn
from disagg.bench.text import words_text
from disagg.wire.headers import REQUEST_ID_HEADER

WARMUP_TOKENS = 16
Drive = Callable[[aiohttp.ClientSession, str], Awaitable[tuple[list[RequestResult], float, dict]]]


async def run_conversation(session: aiohttp.ClientSession, url: str, model: str, system: str,
                           conversation: Conversation, output_len: int, timeout_s: float,
                           run_start: float) -> list[RequestResult]:
    """Its turns one after another, each answer appended to the history; stops at the first failure."""
    messages = [{"role": "system", "content": system}]
    results = []
    for turn in conversation.turns:
        await asyncio.sleep(turn.think_time_s)
        messages.append({"role": "user", "content": turn.text})
        payload = chat_payload(model, list(messages), output_len)
        # The servers log each request under this id (the decode's `kv received` line names its KV bytes).
        request_id = {REQUEST_ID_HEADER: f"chat-{conversation.conversation_id}-{turn.turn_index}-{uuid.uuid4().hex[:8]}"}
        result = await send_request(session, url, payload, time.perf_counter() - run_start, timeout_s, request_id)
        result.conversation_id, result.turn_index = conversation.conversation_id, turn.turn_index
        results.append(result)
        if not result.ok:
            break
        messages.append({"role": "assistant", "content": result.text})
    return results


async def drive_conversations(session: aiohttp.ClientSession, url: str, model: str, system: str,
                              conversations: list[Conversation], offsets_s: list[float], output_len: int,
                              max_concurrency: int | None, timeout_s: float) -> tuple[list[list[RequestResult]], float]:
    """Start each conversation at its offset (at most `max_concurrency` at once); (results per
    conversation, duration_s)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(conversation: Conversation, offset_s: float) -> list[RequestResult]:
        await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
        async with limit:  # every request has its own timeout, so this wait is bounded
            return await run_conversation(session, url, model, system, conversation, output_len, timeout_s, start)

    per_conversation = await asyncio.gather(*(one(c, o) for c, o in zip(conversations, offsets_s)))
    return list(per_conversation), time.perf_counter() - start


def chat_load(args: argparse.Namespace, model: str) -> tuple[list[dict], Drive]:
    """(warm-up payloads, the run): the run returns (results, duration_s, the workload's report part)."""
    config = chat_config(args)
    conversations = make_conversations(config)
    system = system_prompt(config)
    offsets_s = arrival_offsets_s(len(conversations), args.request_rate, args.seed)
    rng = np.random.default_rng([args.seed, 4])  # warm-ups share no prefix with the conversations
    warmups = [chat_payload(model, [{"role": "user", "content": words_text(rng, WARMUP_TOKENS)}], args.output_len)
               for _ in range(args.num_warmups)]

    async def drive(session: aiohttp.ClientSession, url: str) -> tuple[list[RequestResult], float, dict]:
        per_conversation, duration_s = await drive_conversations(
            session, url, model, system, conversations, offsets_s, args.output_len, args.max_concurrency,
            args.timeout_s)
        num_turns = config.turns_per_conversation
        num_done = sum(len(rs) == num_turns and all(r.ok for r in rs) for rs in per_conversation)
        results = [r for rs in per_conversation for r in rs]
        return results, duration_s, {"num_conversations": len(conversations),
                                     "num_conversations_completed": num_done,
                                     "num_turns_offered": len(conversations) * num_turns, "per_turn": per_turn(results)}

    return warmups, drive
