"""DP routing fields of a generate request (DESIGN.md section 3): body, deprecated alias, header."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from disagg.api.bodies import RoutedBody, decode_body
from disagg.api.errors import BadRequest

DP_RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True)
class Routing:
    """Where a request should run, and the P/D fields that travel with it to the worker."""

    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    kv_transfer_params: dict | None = None


def read_routing(request: web.Request, raw: bytes, warn_once: Callable[[str, str], None]) -> Routing:
    """The routing of one request; the `X-data-parallel-rank` header wins over the body.

    `warn_once(key, message)` logs the deprecated `data_parallel_rank` alias once per server.
    """
    body = decode_body(raw, RoutedBody)
    rank = body.routed_dp_rank
    if body.data_parallel_rank is not None:
        warn_once("data_parallel_rank", "request field data_parallel_rank is deprecated; use routed_dp_rank")
        if rank is None:
            rank = body.data_parallel_rank
    header = request.headers.get(DP_RANK_HEADER)
    if header is not None:
        rank = _parse_rank_header(header)
    return Routing(rank, body.disagg_prefill_dp_rank, body.bootstrap_host, body.bootstrap_port, body.bootstrap_room,
                   body.kv_transfer_params)


def _parse_rank_header(value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise BadRequest(f"{DP_RANK_HEADER} header must be an integer, got {value!r}", DP_RANK_HEADER) from None
