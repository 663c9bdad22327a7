"""`n > 1`: n choices for one prompt, as vLLM's parallel sampling does it.

The request forks into n child requests (`<i>_<request id>`, vLLM's naming) on one DP worker, so
the prompt's KV blocks are computed once and shared through the prefix cache. A seeded request's
child i is seeded `seed + i` (vLLM's rule): choices differ from one another and repeat exactly.
OpenAI bodies get one choice per child (`choices[i].index = i`, usage counting the prompt once);
SGLang's /generate answers a list of n bodies (streamed events carry `index`). Any child's failure
fails the request and aborts the others. On a P/D pair each child has its own bootstrap room (the
parent's plus its index) on both legs; the decode's children after the first reserve through its
prefix cache once the first child's KV landed, so only their last block moves.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import msgspec
from aiohttp import web

from disagg.api.errors import to_api_error
from disagg.api.generation import Generation, Totals
from disagg.api.logging import bind_request
from disagg.api.serving import (
    Renderer, admit, end_stream_if_drained, json_response, serve_generation, shutdown_if_drained,
)
from disagg.api.sse import ClientGone, SSEWriter
from disagg.api.state import state_of
from disagg.config import DisaggregationMode
from disagg.http_edge import BadRequest
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg
from disagg.wire.headers import DP_RANK_HEADER, REQUEST_ID_HEADER

MAX_N = 64  # choices per request; each is a full request on the worker
ROOM_SPACE = 1 << 63  # bootstrap rooms are 63-bit


def check_n(n: int | None) -> int:
    """`n` (default 1) within [1, MAX_N]."""
    if n is None:
        return 1
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"n must be between 1 and {MAX_N}, got {n}", "n")
    return n


def child_room(room: int, index: int) -> int:
    """Child `index`'s bootstrap room: the parent's plus the index, within 63 bits. The prefill and
    the decode of a P/D pair fork alike, so each child's legs meet in the same room."""
    return (room + index) % ROOM_SPACE


def child_msgs(msg: GenerateMsg, n: int) -> list[GenerateMsg]:
    """The n children: ids `<i>_<request id>`, seeds `seed + i` when seeded, rooms `child_room`."""
    seed, room = msg.sampling.seed, msg.bootstrap_room
    return [msgspec.structs.replace(
        msg, request_id=f"{i}_{msg.request_id}",
        sampling=msg.sampling if seed is None else dataclasses.replace(msg.sampling, seed=seed + i),
        bootstrap_room=None if room is None else child_room(room, i))
        for i in range(n)]


async def serve_choices(request: web.Request, msg: GenerateMsg, routed_dp_rank: int | None,
                        new_renderer: Callable[[], Renderer], *, n: int, stream: bool,
                        merge: Callable[[list[object], list[Totals], str], object]) -> web.StreamResponse:
    """Like serve_generation, with n choices; `merge(bodies, totals, request_id)` joins the children's
    whole bodies. On a P/D pair (push) both legs fork alike: child i's room is `child_room(room, i)`;
    its first token is the prefill's draw with seed + i, as one engine's child i draws it."""
    if n == 1:
        return await serve_generation(request, msg, routed_dp_rank, new_renderer(), stream=stream)
    if isinstance(msg.kv_transfer_params, dict):
        raise BadRequest("n > 1 is not supported in the pull flow (kv_transfer_params): each choice needs its "
                         "own ticket; send n requests, or use the push flow or a unified server", "n")
    state = state_of(request)
    bind_request(msg.request_id)
    admit(state, request.headers)
    with state.drain.track():
        children = child_msgs(msg, n)
        # A prefill places each child by its own room (the decode resolves that room's rank); any other
        # server keeps the children on one worker, where they share the prompt's blocks.
        per_child = msg.bootstrap_room is not None and state.engine.mode is DisaggregationMode.PREFILL
        ranks = ([state.engine.pick_rank(routed_dp_rank, c.bootstrap_room, c) for c in children] if per_child
                 else [state.engine.pick_rank(routed_dp_rank, None, msg)] * n)
        dp_rank = ranks[0]
        state.metrics.vllm.observe_n(dp_rank, n)
        generations = [Generation(state, child, rank, times_first_token=i == 0)
                       for i, (child, rank) in enumerate(zip(children, ranks))]
        renderers = [new_renderer() for _ in range(n)]
        headers = {DP_RANK_HEADER: str(dp_rank), REQUEST_ID_HEADER: msg.request_id}
        if stream:
            return await _stream(request, msg.request_id, generations, renderers, headers, state.drain)
        with shutdown_if_drained(state.drain):
            totals = await _collect_all(generations)
        bodies = [r.full(t) for r, t in zip(renderers, totals)]
        return json_response(merge(bodies, totals, msg.request_id), headers=headers)


class _Children:
    """The children's outputs on one queue, as `(index, output)`, `(index, None)` at its end, or
    `(index, exception)`. Child 0 runs first; the others start once its prompt is computed (its first
    output), so they find the prompt's full blocks in the worker's prefix cache."""

    def __init__(self, generations: list[Generation]):
        self.generations = generations
        self.queue: asyncio.Queue[tuple[int, OutputMsg | BaseException | None]] = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._feed(0))]

    async def _feed(self, index: int) -> None:
        try:
            async for out in self.generations[index].outputs():
                if len(self.tasks) == 1:
                    self.tasks += [asyncio.create_task(self._feed(i)) for i in range(1, len(self.generations))]
                await self.queue.put((index, out))
            await self.queue.put((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which answers it
            await self.queue.put((index, exc))

    async def next(self) -> tuple[int, OutputMsg | None]:
        """The next output; a child's failure is raised."""
        index, out = await self.queue.get()
        if isinstance(out, BaseException):
            raise out
        return index, out

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()  # each Generation aborts its child on the way out
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _collect_all(generations: list[Generation]) -> list[Totals]:
    """Every child's totals; the first failure cancels (and so aborts) the others and is raised."""
    children = _Children(generations)
    try:
        remaining = len(generations)
        while remaining:
            _, out = await children.next()
            remaining -= out is None
    finally:
        await children.close()
    return [g.totals for g in generations]


async def _stream(request: web.Request, request_id: str, generations: list[Generation], renderers: list[Renderer],
                  headers: dict[str, str], drain) -> web.StreamResponse:
    children = _Children(generations)
    try:
        with shutdown_if_drained(drain):
            first = await children.next()  # a child rejected at once (bad prompt, sleeping engine): its real status
        sse = SSEWriter(headers)
        await sse.start(request)
        try:
            await _pump(sse, request_id, generations, renderers, children, first)
            await sse.done()
        except ClientGone:
            pass
        except asyncio.CancelledError:
            await end_stream_if_drained(sse, drain)
        return sse.response
    finally:
        await children.close()


async def _pump(sse: SSEWriter, request_id: str, generations, renderers, children: _Children, first) -> None:
    """Send each child's chunks (indexed) as they come; after the last child, one merged tail."""
    item, remaining = first, len(generations)
    try:
        while True:
            index, out = item
            if out is None:
                remaining -= 1
                if remaining == 0:
                    break
            else:
                chunks = renderers[index].chunks(out, generations[index].totals)
                await sse.send_all([indexed(c, index, request_id) for c in chunks])
            item = await children.next()
        tail = renderers[0].tail(merged_totals([g.totals for g in generations], request_id))
        await sse.send_all(tail)
    except ClientGone:
        raise
    except Exception as exc:  # noqa: BLE001 - a child failed mid-stream: one error event
        await sse.send_error(to_api_error(exc))


def indexed(chunk: object, index: int, request_id: str) -> object:
    """A child's chunk as choice `index` of the parent request."""
    if not isinstance(chunk, dict):
        return chunk
    if "choices" in chunk:  # OpenAI and vLLM bodies
        key = "id" if "id" in chunk else "request_id"
        return {**chunk, key: request_id, "choices": [{**c, "index": index} for c in chunk["choices"]]}
    return {**chunk, "index": index}  # SGLang: each event names its choice


def merged_totals(totals: list[Totals], request_id: str) -> Totals:
    """Totals whose usage counts the prompt once and every choice's tokens."""
    first = totals[0]
    merged = Totals(request_id, first.dp_rank, first.created, num_prompt_tokens=first.num_prompt_tokens,
                    num_cached_tokens=first.num_cached_tokens)
    merged.token_ids = [t for child in totals for t in child.token_ids]
    return merged


def merge_openai(bodies: list[object], totals: list[Totals], request_id: str) -> object:
    """One OpenAI/vLLM body with every child's choice, indexed, and the merged usage."""
    body = dict(bodies[0])
    key = "id" if "id" in body else "request_id"
    body[key] = request_id
    body["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
    body["usage"] = merged_totals(totals, request_id).usage()
    return body


def merge_sglang(bodies: list[object], totals: list[Totals], request_id: str) -> object:
    """SGLang answers n > 1 with a list, one body per choice."""
    return bodies
