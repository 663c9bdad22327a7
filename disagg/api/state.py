"""What every handler of one app shares: config, engine, metrics, in-flight requests."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from disagg.api.admission import FirstTokenWaits
from disagg.api.metrics import ApiMetrics
from disagg.config import ServerConfig
from disagg.dp.protocol import EngineClient
from disagg.drain import Drain
from disagg.http_edge import HttpError
from disagg.tracing import Tracing

log = structlog.get_logger("disagg.api")


@dataclass
class ApiState:
    """Per-app state. `inflight` maps a running request id to its DP rank (for `abort_all`); `drain`
    refuses new generate requests and turns health red once the server shuts down; `handbacks` holds, for
    each running request that has sent its client nothing yet, how to end it with an error instead (a role
    switch hands such requests back to our router: api/generation.py); `waits`, how long requests waited for
    their first output (--ttft-objective-ms: api/admission.py)."""

    config: ServerConfig
    engine: EngineClient
    metrics: ApiMetrics
    inflight: dict[str, int] = field(default_factory=dict)
    handbacks: dict[str, Callable[[HttpError], bool]] = field(default_factory=dict)
    drain: Drain = field(default_factory=Drain)
    waits: FirstTokenWaits = field(default_factory=FirstTokenWaits)
    tracing: Tracing | None = None  # --otlp-traces-endpoint (disagg/tracing.py)
    started_at: int = field(default_factory=lambda: int(time.time()))
    _noted: set[str] = field(default_factory=set)

    def warn_once(self, key: str, message: str) -> None:
        """Log a warning (e.g. a deprecated field) the first time `key` is seen by this server."""
        if key not in self._noted:
            self._noted.add(key)
            log.warning(message)


STATE = web.AppKey("disagg_api_state", ApiState)


def state_of(request: web.Request) -> ApiState:
    """The ApiState of the app serving `request`."""
    return request.app[STATE]
