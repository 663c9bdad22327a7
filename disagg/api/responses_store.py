"""The Responses this server keeps (`store`, the default): by id, each with the chat messages of its
conversation (for a `previous_response_id`), and the background runs with their statuses and, for streamed
ones, their events. Bounded: the oldest answer goes first, never a run still going.
"""

from __future__ import annotations

from collections import OrderedDict

from aiohttp import web

from disagg.api.responses_background import ENDED, BackgroundRuns, EventLog, RunStatus
from disagg.http_edge import BadRequest, HttpError

MAX_STORED_RESPONSES = 1024  # per server; the oldest goes first
MAX_EVENT_LOGS = 64  # streamed background runs whose events are kept to be followed again, per server


class ResponseStore:
    """Stored answers: id -> the chat messages of its conversation (its answer last; None while a background
    run has not ended) and the Response object; and the background runs."""

    def __init__(self, max_size: int = MAX_STORED_RESPONSES):
        self.max_size = max_size
        self._turns: OrderedDict[str, tuple[list[dict] | None, dict]] = OrderedDict()
        self.runs = BackgroundRuns()
        # The events of streamed background runs (the last MAX_EVENT_LOGS of them, runs still going always).
        self.logs: OrderedDict[str, EventLog] = OrderedDict()

    def keep_events(self, response_id: str, events: EventLog) -> None:
        """Keep a streamed run's events to be followed again; the oldest ended ones go past the bound."""
        self.logs[response_id] = events
        ended = [rid for rid, log in self.logs.items() if log.ended]
        for rid in ended[:max(len(self.logs) - MAX_EVENT_LOGS, 0)]:
            del self.logs[rid]

    def put(self, response_id: str, messages: list[dict] | None, response: dict) -> None:
        if messages is not None and self.status(response_id) == RunStatus.CANCELLED:
            return  # a cancelled run that ended anyway stays cancelled
        self._turns[response_id] = messages, response
        while len(self._turns) > self.max_size:
            oldest = next((rid for rid in self._turns if rid not in self.runs and rid != response_id), None)
            if oldest is None:
                return  # every answer kept is a background run still going: none is forgotten mid-run
            del self._turns[oldest]
            self.logs.pop(oldest, None)

    def status(self, response_id: str) -> str | None:
        """The stored Response's status; None when it is not stored."""
        return self._turns[response_id][1]["status"] if response_id in self._turns else None

    def set_status(self, response_id: str, status: RunStatus, error: dict | None = None) -> None:
        """A background run's Response moves on (one that ended, or was forgotten, stays as it is)."""
        if self.status(response_id) in (None, *ENDED):
            return
        messages, response = self._turns[response_id]
        self._turns[response_id] = messages, {**response, "status": status.value, "error": error}

    def get(self, response_id: str) -> list[dict]:
        """The conversation of a stored answer (400 naming `previous_response_id` when it is not stored)."""
        if response_id not in self._turns:
            raise BadRequest(f"previous_response_id {response_id!r} is not stored on this server (unknown, "
                             f"forgotten after {self.max_size} answers, or sent with store: false)",
                             "previous_response_id")
        messages, response = self._turns[response_id]
        if messages is None:
            raise BadRequest(f"previous_response_id {response_id!r} has no answer to follow: its background "
                             f"run is {response['status']}", "previous_response_id")
        return list(messages)

    def response(self, response_id: str) -> dict:
        """The stored Response object; 404 when it is not stored."""
        if response_id not in self._turns:
            raise not_found(response_id)
        return self._turns[response_id][1]

    async def delete(self, response_id: str) -> None:
        """Forget an answer; a background run still going is cancelled first (404 unknown id)."""
        if response_id not in self._turns:
            raise not_found(response_id)
        if response_id in self.runs:
            self.set_status(response_id, RunStatus.CANCELLED)
            await self.runs.cancel(response_id)
        self._turns.pop(response_id, None)
        self.logs.pop(response_id, None)

    def events(self, response_id: str) -> EventLog:
        """The events of a streamed background run (404 unknown id; 400 an answer that was not one)."""
        if self.status(response_id) is None:
            raise not_found(response_id)
        events = self.logs.get(response_id)
        if events is None:
            raise BadRequest(f"response {response_id!r} was not run in the background with stream: true (or its "
                             f"events are no longer kept: the last {MAX_EVENT_LOGS} are); retrieve it without stream",
                             "stream")
        return events

    async def cancel(self, response_id: str) -> dict:
        """Stop a background run that has not ended; its Response, `cancelled` (404 unknown, 400 otherwise)."""
        status = self.status(response_id)
        if status is None:
            raise not_found(response_id)
        if status in ENDED or response_id not in self.runs:
            raise BadRequest("Cannot cancel a synchronous response.", "response_id")  # vLLM's words
        self.set_status(response_id, RunStatus.CANCELLED)
        await self.runs.cancel(response_id)
        return self.response(response_id)


def not_found(response_id: str) -> HttpError:
    return HttpError(404, f"Response with id {response_id!r} not found.", code="response_not_found")


STORE = web.AppKey("disagg_responses", ResponseStore)
