"""Responses run in the background (`background: true`, as OpenAI and vLLM serve it): the answer at once is
the Response with status `queued` and no output; the generation goes on in a task of this server and its
Response is stored as it goes: `in_progress` from its first output, then `completed` or `incomplete` (whole,
its conversation kept for a `previous_response_id`), `failed` (with `error`) or `cancelled`.
`GET /v1/responses/{id}` reads it; `POST /v1/responses/{id}/cancel` stops a run that has not ended (its
request aborted, its blocks freed as any abort frees them) and answers the Response as `cancelled`.

A background run needs `store` (vLLM's rule and words). With `stream: true` the answer is the run's event
stream instead; the events are kept beside the Response (those of the last runs), so a client that left
follows the run again with `GET /v1/responses/{id}?stream=true&starting_after=N`; leaving never stops the
run. A run that fails ends its events with `response.failed`; a cancelled one's simply end. On P/D the decode runs
it; the prefill leg of the same body is served as usual (the router waits for it, so the `queued` answer
comes once the prompt's KV went out).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from disagg.api.errors import to_api_error
from disagg.api.generation import Generation, Totals
from disagg.api.logging import bind_request
from disagg.api.serving import admit, json_response
from disagg.api.sse import ClientGone, SSEWriter
from disagg.api.state import state_of
from disagg.http_edge import BadRequest, HttpError
from disagg.wire.engine_msgs import GenerateMsg, OutputMsg
from disagg.wire.headers import DP_RANK_HEADER, REQUEST_ID_HEADER

if TYPE_CHECKING:
    from disagg.api.responses import ResponsesRenderer
    from disagg.api.responses_store import ResponseStore

log = structlog.get_logger("disagg.api")


class RunStatus(str, enum.Enum):
    """A background run's Response `status`, as OpenAI names them."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"


ENDED = (RunStatus.COMPLETED, RunStatus.INCOMPLETE, RunStatus.FAILED, RunStatus.CANCELLED)


def check_background(background: bool | None, store: bool | None) -> bool:
    """Whether the request runs in the background; 400 for what cannot (store false)."""
    if not background:
        return False
    if store is False:
        raise BadRequest("background can only be used when `store` is true", "background")
    return True


def error_object(err: HttpError) -> dict:
    """A failed run's `error`, in the Response object's shape (`code`, `message`)."""
    code = "server_error" if err.status >= 500 else "rate_limit_exceeded" if err.status == 429 else "invalid_prompt"
    return {"code": code, "message": err.message}


class BackgroundRuns:
    """The background runs of this server by response id, while they run."""

    def __init__(self):
        self._tasks: dict[str, asyncio.Task] = {}

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._tasks

    def start(self, response_id: str, run: Awaitable[None], on_done: Callable[[], None] | None = None) -> None:
        """Run `run` as the response's task; `on_done` once it ended, however (even cancelled before it began)."""
        task = asyncio.create_task(run, name=f"background-{response_id}")
        self._tasks[response_id] = task

        def ended(_: asyncio.Task) -> None:
            self._tasks.pop(response_id, None)
            if on_done is not None:
                on_done()
        task.add_done_callback(ended)

    async def cancel(self, response_id: str) -> None:
        """Stop a run and wait until its request was aborted."""
        task = self._tasks.get(response_id)
        if task is None:
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def close(self, _app: web.Application | None = None) -> None:
        """Cancel every run (the server stops)."""
        for response_id in list(self._tasks):
            await self.cancel(response_id)


class EventLog:
    """A streamed background run's events as they come (each one's `sequence_number` is its place)."""

    def __init__(self):
        self.events: list = []
        self.ended = False
        self._grown = asyncio.Event()

    def extend(self, events: list) -> None:
        self.events.extend(events)
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        self._grown.set()
        self._grown = asyncio.Event()

    async def follow(self, starting_after: int) -> AsyncIterator[list]:
        """The events after sequence number `starting_after` (-1: all), then each new batch, to the end."""
        at = starting_after + 1
        while True:
            grown = self._grown
            if at < len(self.events):
                batch, at = self.events[at:], len(self.events)
                yield batch
            elif self.ended:
                return
            else:
                await grown.wait()


async def follow_events(request: web.Request, events: EventLog, starting_after: str | None,
                        headers: dict[str, str] | None = None) -> web.StreamResponse:
    """An SSE answer following `events` from after `starting_after` to the run's end; a client that leaves
    stops only its own stream."""
    try:
        after = -1 if starting_after is None else int(starting_after)
    except ValueError:
        raise BadRequest(f"starting_after must be an integer, got {starting_after!r}", "starting_after") from None
    if after < -1:
        raise BadRequest(f"starting_after must be at least -1, got {after}", "starting_after")
    sse = SSEWriter(headers or {})
    try:
        await sse.start(request)
        async for batch in events.follow(after):
            await sse.send_all(batch)
        await sse.done()
    except ClientGone:
        log.info("a client stopped following a background response; the run goes on")
    return sse.response


async def start_in_background(request: web.Request, msg: GenerateMsg, routed_dp_rank: int | None,
                              renderer: ResponsesRenderer, store: ResponseStore, stream: bool) -> web.StreamResponse:
    """Admit the request as any (429, 503 and a duplicate id answered now), store it `queued`, run it;
    the answer is the `queued` Response, or with `stream` the run's events as they come."""
    state, rid = state_of(request), msg.request_id
    bind_request(rid)
    if rid in store.runs:  # its Generation is not yet in flight: the check Generation makes, early
        raise BadRequest(f"request id {rid!r} is already in use", "request_id")
    admit(state, request.headers)
    dp_rank = state.engine.pick_rank(routed_dp_rank, msg.bootstrap_room, msg)
    state.metrics.vllm.observe_n(dp_rank, 1)
    generation = Generation(state, msg, dp_rank)
    queued = renderer.response(generation.totals, RunStatus.QUEUED.value, [])
    store.put(rid, None, queued)
    events = EventLog() if stream else None
    if events is not None:
        store.keep_events(rid, events)

    def set_status(status: RunStatus, error: dict | None) -> None:
        store.set_status(rid, status, error)
        if events is not None and status is RunStatus.FAILED and store.status(rid) == RunStatus.FAILED:
            events.extend([renderer.event("response.failed", response=store.response(rid))])

    def on_output(out: OutputMsg, totals: Totals) -> None:
        events.extend(renderer.chunks(out, totals))  # its last stores the whole Response, as a stream's does

    async def run() -> None:
        with state.drain.track():
            await run_in_background(generation, set_status, renderer.full if events is None else None,
                                    None if events is None else on_output)

    store.runs.start(rid, run(), None if events is None else events.end)
    headers = {DP_RANK_HEADER: str(dp_rank), REQUEST_ID_HEADER: rid}
    return json_response(queued, headers=headers) if events is None else await follow_events(request, events, None,
                                                                                               headers)


async def run_in_background(generation: Generation, set_status: Callable[[RunStatus, dict | None], None],
                            finish: Callable[[Totals], object] | None,
                            on_output: Callable[[OutputMsg, Totals], None] | None = None) -> None:
    """Drive `generation` to its end: `in_progress` at its first output, each output to `on_output`, then
    `finish(totals)` stores the whole Response; a failure stores `failed` with its error. A cancellation
    (the cancel route, the server stopping) aborts the request on its way out of `outputs()`."""
    try:
        async with aclosing(generation.outputs()) as outputs:
            started = False
            async for out in outputs:
                if not started:
                    set_status(RunStatus.IN_PROGRESS, None)
                    started = True
                if on_output is not None:
                    on_output(out, generation.totals)
        if finish is not None:
            finish(generation.totals)
    except asyncio.CancelledError:
        set_status(RunStatus.CANCELLED, None)
        raise
    except Exception as exc:  # noqa: BLE001 - this run fails alone; its Response says why
        err = to_api_error(exc)
        log.warning("background response failed", request_id=generation.totals.request_id, status=err.status,
                    error=err.message)
        set_status(RunStatus.FAILED, error_object(err))
