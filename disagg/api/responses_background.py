"""Responses run in the background (`background: true`, as OpenAI and vLLM serve it): the answer at once is
the Response with status `queued` and no output; the generation goes on in a task of this server and its
Response is stored as it goes: `in_progress` from its first output, then `completed` or `incomplete` (whole,
its conversation kept for a `previous_response_id`), `failed` (with `error`) or `cancelled`.
`GET /v1/responses/{id}` reads it; `POST /v1/responses/{id}/cancel` stops a run that has not ended (its
request aborted, its blocks freed as any abort frees them) and answers the Response as `cancelled`.

A background run needs `store` (vLLM's rule and words) and is not streamed here (a 400 says to poll). On
P/D the decode runs it; the prefill leg of the same body is served as usual (the router waits for it, so
the `queued` answer comes once the prompt's KV went out).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import aclosing

import structlog
from aiohttp import web

from disagg.api.errors import to_api_error
from disagg.api.generation import Generation, Totals
from disagg.http_edge import BadRequest, HttpError

log = structlog.get_logger("disagg.api")
ENDED = ("completed", "incomplete", "failed", "cancelled")


def check_background(background: bool | None, store: bool | None, stream: bool | None) -> bool:
    """Whether the request runs in the background; 400 for what cannot (store false, a stream)."""
    if not background:
        return False
    if store is False:
        raise BadRequest("background can only be used when `store` is true", "background")
    if stream:
        raise BadRequest("background responses are not streamed by this server: send stream false and poll "
                         "GET /v1/responses/{id}", "stream")
    return True


def error_object(err: HttpError) -> dict:
    """A failed run's `error`, in the Response object's shape (`code`, `message`)."""
    return {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}


class BackgroundRuns:
    """The background runs of this server by response id, while they run."""

    def __init__(self):
        self._tasks: dict[str, asyncio.Task] = {}

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._tasks

    def start(self, response_id: str, run: Awaitable[None]) -> None:
        task = asyncio.create_task(run, name=f"background-{response_id}")
        self._tasks[response_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(response_id, None))

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


async def run_in_background(generation: Generation, set_status: Callable[[str, dict | None], None],
                            finish: Callable[[Totals], object]) -> None:
    """Drive `generation` to its end: `in_progress` at its first output, then `finish(totals)` stores the
    whole Response; a failure stores `failed` with its error. A cancellation (the cancel route, the server
    stopping) aborts the request on its way out of `outputs()`."""
    try:
        async with aclosing(generation.outputs()) as outputs:
            if await anext(outputs, None) is not None:
                set_status("in_progress", None)
            async for _ in outputs:
                pass
        finish(generation.totals)
    except asyncio.CancelledError:
        set_status("cancelled", None)
        raise
    except Exception as exc:  # noqa: BLE001 - this run fails alone; its Response says why
        err = to_api_error(exc)
        log.warning("background response failed", request_id=generation.totals.request_id, status=err.status,
                    error=err.message)
        set_status("failed", error_object(err))
