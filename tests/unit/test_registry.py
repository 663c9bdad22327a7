"""Bootstrap registry policy: exact values, no I/O, time passed in."""

import pytest

from bootstrap.registry import (
    BootstrapRegistry,
    ConflictingRegistration,
    IncompleteTopology,
    InvalidRegistration,
    Registration,
    RegistryFull,
    UnknownRank,
)
from disagg.wire.bootstrap_msgs import RankRegistrationMsg, RouteBodyMsg, TopologyMsg, parse_route_query

pytestmark = pytest.mark.timeout(10)


def rank(dp_rank=0, tp_rank=0, dp_size=2, tp_size=1, port=None, **kw):
    port = port if port is not None else 9000 + 10 * dp_rank + tp_rank
    return RankRegistrationMsg(
        dp_rank=dp_rank, dp_size=dp_size, tp_rank=tp_rank, tp_size=tp_size, rank_ip="10.0.0.1",
        rank_port=port, page_size=16, kv_cache_dtype="bfloat16", load_balance_method="round_robin",
        transfer_backend="tcp", agent_name=f"prefill-{dp_rank}-{tp_rank}", **kw,
    )


def test_topology_is_incomplete_until_every_rank_registered():
    reg = BootstrapRegistry()
    with pytest.raises(IncompleteTopology, match=r"^prefill server not fully registered yet: 0 of an unknown number of ranks$"):
        reg.topology()
    assert reg.register_rank(rank(0, 0, tp_size=2)) is Registration.NEW
    assert reg.register_rank(rank(1, 1, tp_size=2)) is Registration.NEW
    assert reg.register_rank(rank(0, 1, tp_size=2)) is Registration.NEW
    assert (reg.num_registered, reg.num_expected, reg.is_complete()) == (3, 4, False)
    with pytest.raises(IncompleteTopology, match=r"^prefill server not fully registered yet: 3 of 4 ranks$") as info:
        reg.topology()
    assert (info.value.num_registered, info.value.num_expected) == (3, 4)
    with pytest.raises(IncompleteTopology):
        reg.rank(0, 0)  # present, but the topology is not served until complete
    reg.register_rank(rank(1, 0, tp_size=2))
    assert reg.is_complete()
    assert reg.topology() == TopologyMsg(
        dp_size=2, tp_size=2, pp_size=1, cp_size=1, page_size=16, kv_cache_dtype="bfloat16",
        load_balance_method="round_robin", transfer_backend="tcp",
    )
    assert reg.topology().num_ranks == 4
    assert reg.topology().follow_bootstrap_room is False
    assert reg.rank(1, 1).rank_port == 9011
    assert [(r.dp_rank, r.tp_rank) for r in reg.ranks()] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_unknown_rank_is_reported_even_before_completion():
    reg = BootstrapRegistry()
    reg.register_rank(rank(0))
    with pytest.raises(UnknownRank, match=r"^unknown rank: dp_rank 2 is out of range for dp_size 2$"):
        reg.rank(2)
    reg.register_rank(rank(1))
    with pytest.raises(UnknownRank, match=r"^unknown rank: tp_rank 1 is out of range for tp_size 1$"):
        reg.rank(0, tp_rank=1)
    with pytest.raises(UnknownRank, match=r"^unknown rank: pp_rank 3 is out of range for pp_size 1$"):
        reg.rank(0, pp_rank=3)


def test_reregistration_replaces_the_address_and_counts_once():
    reg = BootstrapRegistry()
    assert reg.register_rank(rank(0, port=9000)) is Registration.NEW
    assert reg.register_rank(rank(0, port=9000)) is Registration.REPEATED
    assert reg.register_rank(rank(0, port=9500)) is Registration.REPLACED
    assert reg.num_registered == 1
    reg.register_rank(rank(1))
    assert reg.rank(0).rank_port == 9500


def test_conflicting_shape_is_refused_and_changes_nothing():
    reg = BootstrapRegistry()
    reg.register_rank(rank(0))
    bad = RankRegistrationMsg(
        dp_rank=1, dp_size=2, rank_ip="10.0.0.1", rank_port=9010, page_size=32,
        kv_cache_dtype="float32", load_balance_method="round_robin", transfer_backend="tcp",
    )
    with pytest.raises(ConflictingRegistration) as info:
        reg.register_rank(bad)
    assert str(info.value) == (
        "registration conflicts with the ranks already registered: page_size=32 (registered: 16), "
        "kv_cache_dtype='float32' (registered: 'bfloat16')"
    )
    assert reg.num_registered == 1
    with pytest.raises(ConflictingRegistration, match=r"dp_size=4 \(registered: 2\)"):
        reg.register_rank(rank(1, dp_size=4))


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(dp_rank=2), "dp_rank 2 is out of range for dp_size 2"),
        (dict(tp_rank=1), "tp_rank 1 is out of range for tp_size 1"),
        (dict(dp_size=0, dp_rank=0), "dp_size must be at least 1, got 0"),
        (dict(port=0), "rank_port must be in [1, 65535], got 0"),
        (dict(pp_rank=1), "pp_rank 1 is out of range for pp_size 1"),
    ],
)
def test_out_of_range_registration_is_invalid(kw, message):
    with pytest.raises(InvalidRegistration) as info:
        BootstrapRegistry().register_rank(rank(**kw))
    assert str(info.value) == message


def test_room_expires_exactly_at_ttl():
    reg = BootstrapRegistry(room_ttl_s=120.0)
    reg.register_room(7, 1, now=1000.0)
    assert reg.query_rooms([7], now=1000.0) == {7: 1}
    assert reg.query_rooms([7], now=1119.999) == {7: 1}
    assert reg.query_rooms([7], now=1120.0) == {}
    assert reg.num_rooms == 0  # purged, not just hidden


def test_reregistering_a_room_overwrites_the_rank_and_restarts_the_ttl():
    reg = BootstrapRegistry(room_ttl_s=10.0)
    reg.register_room(5, 0, now=0.0)
    reg.register_room(6, 0, now=1.0)
    reg.register_room(5, 1, now=5.0)
    assert reg.query_rooms([5, 6], now=10.5) == {5: 1, 6: 0}
    assert reg.query_rooms([5, 6], now=11.0) == {5: 1}
    assert reg.query_rooms([5, 6], now=15.0) == {}


def test_batch_query_returns_exactly_the_known_rooms():
    reg = BootstrapRegistry(room_ttl_s=60.0)
    reg.register_room(2**63 - 1, 1, now=0.0)
    reg.register_room(11, 0, now=0.0)
    reg.register_room(12, 1, now=30.0)
    assert reg.query_rooms([11, 99, 2**63 - 1, 12, 13], now=10.0) == {11: 0, 2**63 - 1: 1, 12: 1}
    assert reg.query_rooms([11, 12, 99], now=60.0) == {12: 1}
    assert reg.query_rooms([], now=60.0) == {}


def test_purge_counts_only_expired_entries():
    reg = BootstrapRegistry(room_ttl_s=10.0)
    for room in range(5):
        reg.register_room(room, 0, now=room / 2)  # expires at 10.0, 10.5, 11.0, 11.5, 12.0
    assert reg.num_rooms == 5
    assert reg.purge_expired(now=11.0) == 3
    assert reg.num_rooms == 2
    assert reg.query_rooms(range(5), now=11.0) == {3: 0, 4: 0}


FULL = ("the registry holds 3 rooms, its limit (max_rooms): a room can be registered once an entry expires "
        "(10 s after its registration)")


def test_the_room_table_is_capped_after_expiring_stale_entries():
    reg = BootstrapRegistry(room_ttl_s=10.0, max_rooms=3)
    for room in (1, 2, 3):
        reg.register_room(room, 0, now=float(room))  # expire at 11, 12, 13
    with pytest.raises(RegistryFull) as info:
        reg.register_room(4, 0, now=10.999)
    assert str(info.value) == FULL
    assert (reg.num_rooms, reg.query_rooms([1, 2, 3, 4], now=10.999)) == (3, {1: 0, 2: 0, 3: 0})  # nothing changed
    reg.register_room(2, 1, now=10.999)  # a known room is registered again, full or not: now expires at 20.999
    reg.register_room(4, 1, now=11.0)  # room 1 expired at 11.0: its place is free
    assert reg.query_rooms([1, 2, 3, 4], now=11.0) == {2: 1, 3: 0, 4: 1}
    with pytest.raises(RegistryFull):
        reg.register_room(5, 0, now=12.999)
    reg.register_room(5, 0, now=13.0)  # room 3 expired
    assert (reg.num_rooms, reg.query_rooms([2, 4, 5], now=13.0)) == (3, {2: 1, 4: 1, 5: 0})


def test_a_topology_larger_than_max_ranks_is_refused_and_changes_nothing():
    reg = BootstrapRegistry(max_ranks=4)
    with pytest.raises(InvalidRegistration) as info:
        reg.register_rank(rank(0, dp_size=5))
    assert str(info.value) == ("a topology of 5 ranks (dp_size * tp_size * pp_size * cp_size) is more than this "
                               "registry holds (max_ranks 4)")
    assert (reg.num_registered, reg.num_expected) == (0, None)
    assert reg.register_rank(rank(1, tp_rank=1, dp_size=2, tp_size=2)) is Registration.NEW  # 4 ranks: at the limit
    assert reg.num_expected == 4
    with pytest.raises(ValueError, match=r"^max_rooms and max_ranks must be at least 1, got 0, 4$"):
        BootstrapRegistry(max_rooms=0, max_ranks=4)


def test_room_rank_is_checked_against_the_known_dp_size():
    reg = BootstrapRegistry()
    reg.register_room(1, 7, now=0.0)  # no topology yet: any non-negative rank is accepted
    reg.register_rank(rank(0))
    with pytest.raises(InvalidRegistration, match=r"^dp_rank 2 is out of range for dp_size 2$"):
        reg.register_room(1, 2, now=0.0)
    with pytest.raises(InvalidRegistration, match=r"^dp_rank -1 is out of range for dp_size 2$"):
        reg.register_room(1, -1, now=0.0)


def test_every_sglang_dialect_maps_to_one_registration():
    common = dict(rank_ip="10.0.0.2", rank_port=7000)
    current = RouteBodyMsg(
        **common, attn_tp_size=2, attn_tp_rank=1, attn_cp_size=1, attn_cp_rank=0, attn_dp_size=1,
        attn_dp_rank=0, pp_size=1, pp_rank=0, system_dp_size=4, system_dp_rank=3, page_size=64,
    ).to_registration()
    dp_attention = RouteBodyMsg(**common, role="Prefill", attn_tp_size=2, attn_tp_rank=1,
                                attn_dp_size=4, attn_dp_rank=3).to_registration()
    legacy = RouteBodyMsg(**common, role="Prefill", tp_size=8, dp_size=4, engine_rank=7).to_registration()
    world = RouteBodyMsg(**common, role="Prefill", world_size=8, dp_size=4, engine_rank=7).to_registration()
    for reg in (current, dp_attention, legacy, world):
        assert (reg.dp_rank, reg.dp_size, reg.tp_rank, reg.tp_size, reg.pp_size) == (3, 4, 1, 2, 1)
    assert current.page_size == 64 and legacy.page_size is None
    assert legacy.load_balance_method == "follow_bootstrap_room"
    with pytest.raises(ValueError, match=r"^only role 'Prefill' registers ranks, got role 'Decode'$"):
        RouteBodyMsg(**common, role="Decode").to_registration()


def test_route_query_dialects():
    topo = parse_route_query({"prefill_dp_rank": "-1", "prefill_cp_rank": "-1",
                              "target_tp_rank": "-1", "target_pp_rank": "-1"})
    assert topo.is_topology and topo.dialect.value == "sglang"
    legacy = parse_route_query({"engine_rank": "1", "target_dp_group": "2"})
    assert (legacy.dialect.value, legacy.dp_rank, legacy.tp_rank, legacy.pp_rank, legacy.cp_rank) == ("legacy", 2, 1, 0, 0)
    assert parse_route_query({"engine_rank": "-1", "target_dp_group": "-1"}).is_topology
    with pytest.raises(ValueError, match=r"^query parameter engine_rank must be an integer, got 'x'$"):
        parse_route_query({"engine_rank": "x", "target_dp_group": "0", "target_pp_rank": "0"})
    with pytest.raises(ValueError, match=r"target_tp_rank is missing$"):
        parse_route_query({"prefill_dp_rank": "0", "target_pp_rank": "0"})
    with pytest.raises(ValueError, match=r"^rank -1 asks for the topology"):
        parse_route_query({"engine_rank": "-1", "target_dp_group": "0", "target_pp_rank": "0"})


def test_clear_forgets_every_rank_and_room_until_ranks_register_again():
    reg = BootstrapRegistry(room_ttl_s=60.0)
    reg.register_rank(rank(0, dp_size=1))
    reg.register_room(11, 0, now=0.0)
    reg.clear()  # the prefill behind it became a decode
    assert (reg.num_registered, reg.num_expected, reg.is_complete()) == (0, None, False)
    assert reg.query_rooms([11], now=1.0) == {}
    with pytest.raises(IncompleteTopology):
        reg.topology()
    assert reg.register_rank(rank(0, dp_size=2, port=9)) is Registration.NEW  # any shape, as when new
