"""Bootstrap registry: which prefill ranks exist and where, and which prefill DP rank holds a room.

Pure policy: no I/O, no clock of its own. Every method that depends on time takes `now` (seconds
on any monotonic clock); the HTTP server passes its injected clock's reading.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable

from disagg.wire.bootstrap_msgs import RankRegistrationMsg, TopologyMsg

DEFAULT_ROOM_TTL_S = 120.0
DEFAULT_MAX_ROOMS = 100_000  # 120 s of ~800 registered rooms a second; about 15 MB
DEFAULT_MAX_RANKS = 4096

RankKey = tuple[int, int, int, int]  # (dp_rank, cp_rank, tp_rank, pp_rank)


class RegistryError(Exception):
    """Base of the registry's errors; the message is meant for the caller as is."""


class InvalidRegistration(RegistryError, ValueError):
    """A registration or room entry whose values are out of range (HTTP 400)."""


class ConflictingRegistration(RegistryError):
    """A rank describes a different server shape or KV format than the ranks before it (HTTP 409)."""


class UnknownRank(RegistryError, LookupError):
    """No such rank in this topology (HTTP 404)."""


class RegistryFull(RegistryError):
    """The room table holds `max_rooms` live entries (HTTP 429); a new room fits once one expires."""


class IncompleteTopology(RegistryError):
    """Not every expected rank has registered yet (HTTP 503); retry later."""

    def __init__(self, num_registered: int, num_expected: int | None):
        expected = "an unknown number of" if num_expected is None else str(num_expected)
        super().__init__(f"prefill server not fully registered yet: {num_registered} of {expected} ranks")
        self.num_registered = num_registered
        self.num_expected = num_expected


class Registration(enum.Enum):
    """What a `register_rank` call did."""

    NEW = "new"  # first registration of this rank
    REPEATED = "repeated"  # same rank, same address: nothing changed
    REPLACED = "replaced"  # same rank, new address: the rank restarted


def _topology_of(reg: RankRegistrationMsg) -> TopologyMsg:
    return TopologyMsg(
        dp_size=reg.dp_size, tp_size=reg.tp_size, pp_size=reg.pp_size, cp_size=reg.cp_size,
        page_size=reg.page_size, kv_cache_dtype=reg.kv_cache_dtype,
        load_balance_method=reg.load_balance_method, transfer_backend=reg.transfer_backend,
    )


def _check_ranges(reg: RankRegistrationMsg) -> None:
    for name in ("dp", "tp", "pp", "cp"):
        rank, size = getattr(reg, f"{name}_rank"), getattr(reg, f"{name}_size")
        if size < 1:
            raise InvalidRegistration(f"{name}_size must be at least 1, got {size}")
        if not 0 <= rank < size:
            raise InvalidRegistration(f"{name}_rank {rank} is out of range for {name}_size {size}")
    if not reg.rank_ip:
        raise InvalidRegistration("rank_ip must not be empty")
    if not 1 <= reg.rank_port <= 65535:
        raise InvalidRegistration(f"rank_port must be in [1, 65535], got {reg.rank_port}")
    if reg.page_size is not None and reg.page_size < 1:
        raise InvalidRegistration(f"page_size must be at least 1, got {reg.page_size}")


class BootstrapRegistry:
    """Prefill ranks of one prefill server, and room -> prefill DP rank entries with expiry.

    Rules:
    - The first registered rank fixes the topology (sizes, page size, KV dtype, load-balance
      method, transfer backend). A later rank that disagrees raises ConflictingRegistration and
      changes nothing.
    - A rank that registers again replaces its entry: a new address means the rank restarted
      (Registration.REPLACED), the same one is a harmless retry (Registration.REPEATED). Either
      way it counts once.
    - The topology is complete when all dp_size * tp_size * pp_size * cp_size ranks registered.
    - A room entry registered at `now` is known while `now' < now + room_ttl_s` and gone from
      `now + room_ttl_s` on. Registering a room again overwrites its rank and restarts its TTL.
    - Bounded whoever writes: at most `max_rooms` live room entries (a new room beyond them, after
      the expired ones are dropped, raises RegistryFull; a known room may still be registered
      again), and a topology of at most `max_ranks` ranks (a larger one is InvalidRegistration).
    """

    def __init__(self, room_ttl_s: float = DEFAULT_ROOM_TTL_S, max_rooms: int = DEFAULT_MAX_ROOMS,
                 max_ranks: int = DEFAULT_MAX_RANKS):
        if room_ttl_s <= 0:
            raise ValueError(f"room_ttl_s must be positive, got {room_ttl_s}")
        if max_rooms < 1 or max_ranks < 1:
            raise ValueError(f"max_rooms and max_ranks must be at least 1, got {max_rooms}, {max_ranks}")
        self.room_ttl_s = room_ttl_s
        self.max_rooms = max_rooms
        self.max_ranks = max_ranks
        self._topology: TopologyMsg | None = None
        self._ranks: dict[RankKey, RankRegistrationMsg] = {}
        # room -> (dp_rank, expires_at). Ordered by expiry: entries are appended (or moved to the
        # end on refresh) with now + ttl and `now` only grows, so expired entries sit at the front.
        self._rooms: OrderedDict[int, tuple[int, float]] = OrderedDict()

    # --- ranks ---------------------------------------------------------------------------------

    def register_rank(self, reg: RankRegistrationMsg) -> Registration:
        """Add or replace one rank; see the class docstring for the rules."""
        _check_ranges(reg)
        shape = _topology_of(reg)
        if shape.num_ranks > self.max_ranks:
            raise InvalidRegistration(f"a topology of {shape.num_ranks} ranks (dp_size * tp_size * pp_size * cp_size) "
                                      f"is more than this registry holds (max_ranks {self.max_ranks})")
        if self._topology is not None and shape != self._topology:
            raise ConflictingRegistration(self._conflict_message(shape))
        key = (reg.dp_rank, reg.cp_rank, reg.tp_rank, reg.pp_rank)
        old = self._ranks.get(key)
        self._topology = shape
        self._ranks[key] = reg
        if old is None:
            return Registration.NEW
        same = (old.rank_ip, old.rank_port, old.agent_name) == (reg.rank_ip, reg.rank_port, reg.agent_name)
        return Registration.REPEATED if same else Registration.REPLACED

    def clear(self) -> None:
        """Forget every rank and room: the prefill behind this registry left its role (a role switch);
        lookups answer "not yet" until ranks register again, never with a rank that stopped serving."""
        self._topology = None
        self._ranks.clear()
        self._rooms.clear()

    def _conflict_message(self, shape: TopologyMsg) -> str:
        assert self._topology is not None
        diffs = [
            f"{name}={getattr(shape, name)!r} (registered: {getattr(self._topology, name)!r})"
            for name in TopologyMsg.__struct_fields__
            if getattr(shape, name) != getattr(self._topology, name)
        ]
        return "registration conflicts with the ranks already registered: " + ", ".join(diffs)

    @property
    def num_registered(self) -> int:
        """Distinct ranks registered so far."""
        return len(self._ranks)

    @property
    def num_expected(self) -> int | None:
        """Ranks the topology needs; None before the first registration."""
        return None if self._topology is None else self._topology.num_ranks

    def is_complete(self) -> bool:
        """True once every expected rank has registered."""
        return self._topology is not None and len(self._ranks) == self._topology.num_ranks

    def topology(self) -> TopologyMsg:
        """The server's shape; raises IncompleteTopology until every expected rank registered."""
        if not self.is_complete():
            raise IncompleteTopology(self.num_registered, self.num_expected)
        assert self._topology is not None
        return self._topology

    def rank(self, dp_rank: int, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> RankRegistrationMsg:
        """One rank's registration.

        UnknownRank when a rank is outside the (known) sizes, IncompleteTopology while ranks are
        still missing: a rank that may yet register is "not yet", not "unknown".
        """
        t = self._topology
        if t is not None:
            for name, rank, size in (("dp", dp_rank, t.dp_size), ("tp", tp_rank, t.tp_size),
                                     ("pp", pp_rank, t.pp_size), ("cp", cp_rank, t.cp_size)):
                if not 0 <= rank < size:
                    raise UnknownRank(f"unknown rank: {name}_rank {rank} is out of range for {name}_size {size}")
        if not self.is_complete():
            raise IncompleteTopology(self.num_registered, self.num_expected)
        return self._ranks[(dp_rank, cp_rank, tp_rank, pp_rank)]

    def ranks(self) -> list[RankRegistrationMsg]:
        """Every registered rank, ordered by (dp, cp, tp, pp)."""
        return [self._ranks[key] for key in sorted(self._ranks)]

    # --- rooms ---------------------------------------------------------------------------------

    def register_room(self, room: int, dp_rank: int, now: float) -> None:
        """Record that prefill DP rank `dp_rank` serves `room`, until now + room_ttl_s."""
        if not 0 <= room < 2**64:
            raise InvalidRegistration(f"bootstrap_room must be in [0, 2**64), got {room}")
        if dp_rank < 0 or (self._topology is not None and dp_rank >= self._topology.dp_size):
            size = "unknown" if self._topology is None else self._topology.dp_size
            raise InvalidRegistration(f"dp_rank {dp_rank} is out of range for dp_size {size}")
        self.purge_expired(now)
        if room not in self._rooms and len(self._rooms) >= self.max_rooms:
            raise RegistryFull(f"the registry holds {len(self._rooms)} rooms, its limit (max_rooms): a room can be "
                               f"registered once an entry expires ({self.room_ttl_s:g} s after its registration)")
        self._rooms[room] = (dp_rank, now + self.room_ttl_s)
        self._rooms.move_to_end(room)

    def query_rooms(self, rooms: Iterable[int], now: float) -> dict[int, int]:
        """room -> dp_rank for the rooms known at `now`; unknown and expired rooms are left out."""
        self.purge_expired(now)
        found = {}
        for room in rooms:
            entry = self._rooms.get(room)
            if entry is not None and now < entry[1]:
                found[room] = entry[0]
        return found

    def purge_expired(self, now: float) -> int:
        """Drop entries whose expiry is at or before `now`; returns how many were dropped."""
        dropped = 0
        while self._rooms:
            room, (_, expires_at) = next(iter(self._rooms.items()))
            if expires_at > now:
                break
            del self._rooms[room]
            dropped += 1
        return dropped

    @property
    def num_rooms(self) -> int:
        """Room entries held, expired ones not yet purged included."""
        return len(self._rooms)
