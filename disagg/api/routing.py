"""DP routing fields of a generate request (docs/api.md, "DP routing and P/D fields"): body, deprecated alias, header."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from aiohttp import web

from disagg.api.bodies import RoutedBody, decode_body
from disagg.http_edge import BadRequest
from disagg.wire.headers import DP_RANK_HEADER

BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
PULL_FLAGS = ("do_remote_decode", "do_remote_prefill")
ONE_FLOW = ("kv_transfer_params with do_remote_decode or do_remote_prefill (the pull flow) and bootstrap_room "
            "(the push flow) cannot be combined: a request takes one P/D flow (send it through one P/D router)")


@dataclass(frozen=True)
class Routing:
    """Where a request should run, and the P/D fields that travel with it to the worker.

    The bootstrap fields of a batch may be lists, one entry per prompt; `for_items` splits them.
    """

    routed_dp_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None
    kv_transfer_params: dict | None = None
    disagg_prefill_here: bool = False  # a decode prefills the whole prompt itself (docs/api.md)

    def for_items(self, num_items: int) -> list[Routing]:
        """One Routing per prompt of a request with `num_items` prompts. A list must have one entry
        per prompt; one room cannot serve two prompts (each prompt is its own P/D transfer)."""
        columns = {}
        for name in BOOTSTRAP_FIELDS:
            value = getattr(self, name)
            if isinstance(value, list):
                if len(value) != num_items:
                    raise BadRequest(f"{name} has {len(value)} entries for {num_items} prompts: send one per prompt", name)
                columns[name] = value
            elif name == "bootstrap_room" and value is not None and num_items > 1:
                raise BadRequest(f"a batch of {num_items} prompts needs bootstrap_room as a list of {num_items} rooms",
                                 name)
            else:
                columns[name] = [value] * num_items
        return [replace(self, **{name: columns[name][i] for name in BOOTSTRAP_FIELDS}) for i in range(num_items)]


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
    if asks_for_pull(body.kv_transfer_params) and body.bootstrap_room is not None:
        raise BadRequest(ONE_FLOW, "kv_transfer_params")  # one leg would wait for KV the other never sends
    return Routing(rank, body.disagg_prefill_dp_rank, body.bootstrap_host, body.bootstrap_port, body.bootstrap_room,
                   body.kv_transfer_params, body.disagg_prefill_here)


def asks_for_pull(kv_transfer_params: dict | None) -> bool:
    """True when `kv_transfer_params` asks for the pull flow (a prefill's `do_remote_decode`, a decode's ticket)."""
    return isinstance(kv_transfer_params, dict) and any(kv_transfer_params.get(flag) is True for flag in PULL_FLAGS)


def _parse_rank_header(value: str) -> int:
    try:
        return int(value.strip())
    except ValueError:
        raise BadRequest(f"{DP_RANK_HEADER} header must be an integer, got {value!r}", DP_RANK_HEADER) from None
