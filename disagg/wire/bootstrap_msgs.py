"""HTTP bodies of the bootstrap registry, wire-compatible with SGLang's bootstrap server.

Every body is JSON. Requests are decoded leniently (`strict=False`: `"5"` is read as 5, as SGLang's
`int(...)` does) and unknown fields are ignored, because real SGLang prefill ranks send fields we
have no use for. Rooms are JSON integers in requests; in the `POST /query_dp_ranks` answer they are
object keys, hence decimal strings (`{"12345": 1}`).

Two dialects of `GET /route` exist in SGLang releases; both are served (see `parse_route_query`):
- current: `prefill_dp_rank`, `prefill_cp_rank`, `target_tp_rank`, `target_pp_rank`;
- legacy: `engine_rank` (the TP rank), `target_dp_group`, `target_pp_rank`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Annotated

import msgspec

DEFAULT_LOAD_BALANCE_METHOD = "follow_bootstrap_room"

Room = Annotated[int, msgspec.Meta(ge=0)]  # msgspec itself refuses ints beyond uint64
Rank = Annotated[int, msgspec.Meta(ge=0)]
Size = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class RankRegistrationMsg(msgspec.Struct, frozen=True, kw_only=True):
    """One prefill rank in canonical form: what the registry stores and `GET /route` serves.

    `rank_ip:rank_port` is the rank's KV control-plane (gRPC) endpoint; `page_size` is tokens per
    KV block. The size fields and the KV format are the same for every rank of one prefill server.
    """

    dp_rank: int
    dp_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    rank_ip: str
    rank_port: int
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    load_balance_method: str = DEFAULT_LOAD_BALANCE_METHOD
    transfer_backend: str | None = None
    agent_name: str | None = None


class RouteBodyMsg(msgspec.Struct, kw_only=True):
    """Body of `PUT /route` in any SGLang dialect, plus our `transfer_backend` and `agent_name`.

    Current SGLang sends `attn_{tp,cp,dp}_{size,rank}`, `pp_*`, `system_dp_*`; older releases send
    `role`, `engine_rank` (a global rank) with `tp_size` or `world_size` (all TP ranks of all DP
    groups) and `dp_size`. `to_registration` maps every dialect to one `RankRegistrationMsg`.
    """

    rank_ip: str
    rank_port: Port
    role: str | None = None
    attn_tp_size: Size | None = None
    attn_tp_rank: Rank | None = None
    attn_cp_size: Size | None = None
    attn_cp_rank: Rank | None = None
    attn_dp_size: Size | None = None
    attn_dp_rank: Rank | None = None
    system_dp_size: Size | None = None
    system_dp_rank: Rank | None = None
    pp_size: Size | None = None
    pp_rank: Rank | None = None
    tp_size: Size | None = None
    world_size: Size | None = None
    dp_size: Size | None = None
    engine_rank: Rank | None = None
    page_size: Size | None = None
    kv_cache_dtype: str | None = None
    load_balance_method: str | None = None
    transfer_backend: str | None = None
    agent_name: str | None = None

    def to_registration(self) -> RankRegistrationMsg:
        """The canonical registration; ValueError names the inconsistent field."""
        if self.role is not None and self.role != "Prefill":
            raise ValueError(f"only role 'Prefill' registers ranks, got role {self.role!r}")
        dp_size, dp_rank = self._dp()
        tp_size = self._tp_size()
        if self.attn_tp_rank is not None:
            tp_rank = self.attn_tp_rank
        else:
            tp_rank = self.engine_rank % tp_size if self.engine_rank is not None else 0
        if dp_rank is None:
            dp_rank = self.engine_rank // tp_size if self.engine_rank is not None else 0
        return RankRegistrationMsg(
            dp_rank=dp_rank, dp_size=dp_size, tp_rank=tp_rank, tp_size=tp_size,
            pp_rank=self.pp_rank or 0, pp_size=self.pp_size or 1,
            cp_rank=self.attn_cp_rank or 0, cp_size=self.attn_cp_size or 1,
            rank_ip=self.rank_ip, rank_port=self.rank_port, page_size=self.page_size,
            kv_cache_dtype=self.kv_cache_dtype,
            load_balance_method=self.load_balance_method or DEFAULT_LOAD_BALANCE_METHOD,
            transfer_backend=self.transfer_backend, agent_name=self.agent_name,
        )

    def _dp(self) -> tuple[int, int | None]:
        # SGLang: with DP attention every DP group is an attention DP rank of one process group;
        # without it each DP worker is a "system" DP rank and attn_dp_size is 1.
        if self.system_dp_size is not None and self.system_dp_size > 1:
            return self.system_dp_size, self.system_dp_rank or 0
        return self.attn_dp_size or self.dp_size or 1, self.attn_dp_rank

    def _tp_size(self) -> int:
        if self.attn_tp_size is not None:
            return self.attn_tp_size
        total = self.world_size or self.tp_size
        if total is None:
            return 1
        groups = self.dp_size or 1
        if total % groups:
            raise ValueError(f"tp_size/world_size {total} is not a multiple of dp_size {groups}")
        return total // groups


def route_body(reg: RankRegistrationMsg) -> dict:
    """The `PUT /route` body our prefill ranks send: current SGLang field names plus ours."""
    return {
        "attn_tp_size": reg.tp_size, "attn_tp_rank": reg.tp_rank,
        "attn_cp_size": reg.cp_size, "attn_cp_rank": reg.cp_rank,
        "attn_dp_size": reg.dp_size, "attn_dp_rank": reg.dp_rank,
        "system_dp_size": 1, "system_dp_rank": 0,
        "pp_size": reg.pp_size, "pp_rank": reg.pp_rank,
        "rank_ip": reg.rank_ip, "rank_port": reg.rank_port,
        "page_size": reg.page_size, "kv_cache_dtype": reg.kv_cache_dtype,
        "load_balance_method": reg.load_balance_method,
        "transfer_backend": reg.transfer_backend, "agent_name": reg.agent_name,
    }


class TopologyMsg(msgspec.Struct, frozen=True, kw_only=True):
    """The shape of one prefill server, fixed by its first rank's registration."""

    dp_size: int
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    load_balance_method: str = DEFAULT_LOAD_BALANCE_METHOD
    transfer_backend: str | None = None

    @property
    def num_ranks(self) -> int:
        """Ranks that must register before the topology is complete."""
        return self.dp_size * self.tp_size * self.pp_size * self.cp_size

    @property
    def follow_bootstrap_room(self) -> bool:
        """True when the prefill DP rank of a room is `room % dp_size` (no registry query needed)."""
        return self.load_balance_method == DEFAULT_LOAD_BALANCE_METHOD


def sglang_topology(t: TopologyMsg) -> dict:
    """Topology answer of the current dialect: exactly SGLang's `PrefillServerInfo` fields.

    Current SGLang decode builds `PrefillServerInfo(**body)`, so an extra key would break it.
    """
    return {
        "attn_tp_size": t.tp_size, "attn_cp_size": t.cp_size, "dp_size": t.dp_size,
        "pp_size": t.pp_size, "page_size": t.page_size, "kv_cache_dtype": t.kv_cache_dtype,
        "follow_bootstrap_room": t.follow_bootstrap_room,
    }


def full_topology(t: TopologyMsg) -> dict:
    """Topology answer of the legacy dialect: SGLang's legacy keys plus every `TopologyMsg` field."""
    legacy = {"prefill_attn_tp_size": t.tp_size, "prefill_dp_size": t.dp_size, "prefill_pp_size": t.pp_size}
    return {**legacy, **msgspec.to_builtins(t), "follow_bootstrap_room": t.follow_bootstrap_room}


class RankAddressMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Answer of `GET /route` for one rank. SGLang reads `rank_ip` and `rank_port` only."""

    rank_ip: str
    rank_port: int
    dp_rank: int
    tp_rank: int
    pp_rank: int = 0
    cp_rank: int = 0
    agent_name: str | None = None
    transfer_backend: str | None = None


def rank_address(reg: RankRegistrationMsg) -> RankAddressMsg:
    """The public part of a registration."""
    return RankAddressMsg(
        rank_ip=reg.rank_ip, rank_port=reg.rank_port, dp_rank=reg.dp_rank, tp_rank=reg.tp_rank,
        pp_rank=reg.pp_rank, cp_rank=reg.cp_rank, agent_name=reg.agent_name,
        transfer_backend=reg.transfer_backend,
    )


class RouteDialect(enum.Enum):
    SGLANG = "sglang"  # prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank
    LEGACY = "legacy"  # engine_rank, target_dp_group, target_pp_rank


class RouteQueryMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Parsed `GET /route` query. Every rank -1 asks for the topology."""

    dialect: RouteDialect
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp_rank: int

    @property
    def is_topology(self) -> bool:
        """True when the query asks for the topology rather than one rank."""
        return self.dp_rank == -1


_SGLANG_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
_LEGACY_PARAMS = ("target_dp_group", "engine_rank", "target_pp_rank")
_MISSING = (
    "missing query parameters: send prefill_dp_rank, prefill_cp_rank, target_tp_rank and "
    "target_pp_rank (or engine_rank, target_dp_group and target_pp_rank); all -1 asks for the topology"
)


def _int_param(query: Mapping[str, str], name: str, default: int | None) -> int:
    raw = query.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"{_MISSING}; {name} is missing")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"query parameter {name} must be an integer, got {raw!r}") from None
    if value < -1:
        raise ValueError(f"query parameter {name} must be >= -1, got {value}")
    return value


def parse_route_query(query: Mapping[str, str]) -> RouteQueryMsg:
    """Read either dialect; ValueError (a 400) says what is missing or malformed.

    `prefill_cp_rank` (current) and `target_pp_rank` (legacy) may be left out: older releases of
    each dialect did not send them.
    """
    if "prefill_dp_rank" in query:
        dialect, (dp, cp, tp, pp) = RouteDialect.SGLANG, _SGLANG_PARAMS
    elif "engine_rank" in query or "target_dp_group" in query:
        dialect, (dp, tp, pp), cp = RouteDialect.LEGACY, _LEGACY_PARAMS, None
    else:
        raise ValueError(_MISSING)
    dp_rank = _int_param(query, dp, None)
    tp_rank = _int_param(query, tp, None)
    optional = -1 if dp_rank == -1 else 0
    pp_rank = _int_param(query, pp, None if dialect is RouteDialect.SGLANG else optional)
    cp_rank = _int_param(query, cp, optional) if cp else optional
    ranks = (dp_rank, tp_rank, pp_rank, cp_rank)
    if -1 in ranks and any(r != -1 for r in ranks):
        raise ValueError(f"rank -1 asks for the topology, so every rank parameter must be -1; got {dict(query)}")
    return RouteQueryMsg(dialect=dialect, dp_rank=dp_rank, tp_rank=tp_rank, pp_rank=pp_rank, cp_rank=cp_rank)


class RegisterDpRankMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Body of `POST /register_dp_rank`: the prefill DP rank that serves `bootstrap_room`."""

    bootstrap_room: Room
    dp_rank: Rank


class QueryDpRanksMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Body of `POST /query_dp_ranks`; the answer maps each known room (as a string) to its rank."""

    bootstrap_rooms: list[Room]


class ChallengeMsg(msgspec.Struct, frozen=True, kw_only=True):
    """Answer of `GET /challenge`: a nonce (64 hex digits) that one write may answer, once, within
    `expires_in_s` (disagg/wire/auth.py)."""

    nonce: str
    expires_in_s: float


class ErrorMsg(msgspec.Struct, frozen=True):
    """Body of every 4xx/5xx answer of the bootstrap server."""

    error: str


def dp_ranks_body(ranks: Mapping[int, int]) -> dict[str, int]:
    """`POST /query_dp_ranks` answer: JSON object keys are strings, so rooms become decimal strings."""
    return {str(room): rank for room, rank in ranks.items()}


def dp_ranks_from_body(raw: bytes) -> dict[int, int]:
    """Inverse of `dp_ranks_body`, from the raw HTTP answer."""
    return {int(room): rank for room, rank in msgspec.json.decode(raw, type=dict[str, int]).items()}
