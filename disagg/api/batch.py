"""Answer a batched generate request: every prompt submitted at once (so the engine batches them),
one answer holding every item (SGLang's list, OpenAI's choices), or one SSE stream of them all.

A failing item fails the whole request: the other items are aborted and the client gets the error
(before the stream, its status; during it, one error event and `data: [DONE]`).
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Protocol

import structlog
from aiohttp import web

from disagg.api.errors import to_api_error
from disagg.api.generation import Generation, Totals
from disagg.api.logging import bind_request
from disagg.api.serving import admit, end_stream_if_drained, json_response, shutdown_if_drained
from disagg.api.sse import ClientGone, SSEWriter
from disagg.api.state import ApiState, state_of
from disagg.drain import Drain
from disagg.http_edge import BadRequest
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg
from disagg.wire.headers import DP_RANK_HEADER, REQUEST_ID_HEADER

log = structlog.get_logger("disagg.api")
_DONE = object()  # an item's stream ended


class BatchRenderer(Protocol):
    """How one endpoint shapes the answers of a batch."""

    def chunks(self, index: int, out: OutputMsg, totals: Totals) -> list[object]:
        """SSE payloads for one output of item `index` (`totals` already include it)."""

    def tail(self, totals: list[Totals]) -> list[object]:
        """SSE payloads once every item finished (e.g. the usage chunk)."""

    def full(self, totals: list[Totals]) -> object:
        """The non-streaming JSON body."""


async def serve_batch(request: web.Request, items: list[tuple[GenerateMsg, int | None]], renderer: BatchRenderer,
                      *, stream: bool, request_id: str) -> web.StreamResponse:
    """Run every `(msg, routed_dp_rank)` at once on the DP workers the engine picks (by each item's
    room) and answer with `renderer`'s bodies. `request_id` names the batch in headers and logs."""
    state = state_of(request)
    bind_request(request_id)
    ids = [msg.request_id for msg, _ in items]
    duplicate = next((rid for i, rid in enumerate(ids) if rid in ids[:i]), None)
    if duplicate is not None:
        raise BadRequest(f"request id {duplicate!r} appears twice in the batch", "rid")
    admit(state, request.headers)
    with state.drain.track():
        generations = [Generation(state, msg, state.engine.pick_rank(rank, msg.bootstrap_room, msg))
                       for msg, rank in items]
        for generation in generations:  # each prompt is a request of one choice, as vLLM counts them
            state.metrics.vllm.observe_n(generation.totals.dp_rank, 1)
        headers = {DP_RANK_HEADER: str(generations[0].totals.dp_rank), REQUEST_ID_HEADER: request_id}
        if stream:
            return await _stream(request, generations, renderer, headers, state)
        tasks = [asyncio.create_task(g.collect()) for g in generations]
        with shutdown_if_drained(state.drain):
            totals = await all_or_first_error(tasks)
        return json_response(renderer.full(totals), headers=headers)


async def all_or_first_error(tasks: list[asyncio.Task]) -> list:
    """Every task's result in order; the first failure cancels the others and is raised."""
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t in done and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        return [t.result() for t in tasks]
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(index: int, generation: Generation, queue: asyncio.Queue) -> None:
    """Put item `index`'s outputs on `queue`, then `_DONE` or the exception that ended it."""
    try:
        async with aclosing(generation.outputs()) as outputs:
            async for out in outputs:
                await queue.put((index, out))
        await queue.put((index, _DONE))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported to the client by the stream's reader
        await queue.put((index, exc))


async def _stream(request: web.Request, generations: list[Generation], renderer: BatchRenderer,
                  headers: dict[str, str], state: ApiState) -> web.StreamResponse:
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, g, queue)) for i, g in enumerate(generations)]
    try:
        # The first output before the headers: a batch the workers refuse gets its real status.
        first = await _first(queue, state.drain)
        if isinstance(first[1], Exception):
            raise first[1]
        sse = SSEWriter(headers)
        try:
            await sse.start(request)
            await _relay(sse, renderer, generations, first, queue)
            await sse.done()
        except ClientGone:
            log.info("client disconnected mid-stream; aborting the batch")
        except asyncio.CancelledError:
            await end_stream_if_drained(sse, state.drain)
        return sse.response
    finally:
        await _cancel(tasks)


async def _first(queue: asyncio.Queue, drain: Drain) -> tuple:
    with shutdown_if_drained(drain):
        return await queue.get()


async def _relay(sse: SSEWriter, renderer: BatchRenderer, generations: list[Generation], first: tuple,
                 queue: asyncio.Queue) -> None:
    """Every item's chunks as they come, then the tail; a failed item ends the stream with its error."""
    num_open, entry = len(generations), first
    while True:
        index, out = entry
        if out is _DONE:
            num_open -= 1
        elif isinstance(out, Exception):
            await _end_with_error(sse, to_api_error(out), finish=False)
            return
        else:
            await sse.send_all(renderer.chunks(index, out, generations[index].totals))
        if num_open == 0:
            break
        entry = await queue.get()
    await sse.send_all(renderer.tail([g.totals for g in generations]))


async def _end_with_error(sse: SSEWriter, err, finish: bool = True) -> None:
    log.warning("batch failed mid-stream", status=err.status, error=err.message)
    try:
        await sse.send_error(err)
        if finish:
            await sse.done()
    except ClientGone:
        pass
