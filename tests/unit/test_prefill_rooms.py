"""prefill.rooms.RoomTable: rooms kept in deadline order, so expiring them stops at the first live one."""

from prefill.rooms import RoomTable


def test_rooms_expire_oldest_first_and_a_put_again_lives_anew():
    table = RoomTable(ttl_s=30.0)
    table.put(7, "a", now=100.0)
    table.put(8, "b", now=101.0)
    table.put(9, "c", now=102.0)
    table.put(7, "a again", now=103.0)  # 7 moves to the end: it now expires at 133
    assert list(table.items()) == [(8, ("b", 131.0)), (9, ("c", 132.0)), (7, ("a again", 133.0))]
    assert table.pop_expired(131.0) == []  # a deadline equal to now is still live
    assert table.pop_expired(132.5) == [(8, "b"), (9, "c")]
    assert list(table) == [7]
    assert table.pop_expired(200.0) == [(7, "a again")] and table == {}


def test_expiring_stops_at_the_first_live_room():
    table = RoomTable(ttl_s=1.0)
    for room in range(1000):
        table.put(room, room, now=float(room))
    visited = []

    class Counting(RoomTable):
        def items(self):
            for item in super().items():
                visited.append(item[0])
                yield item

    counting = Counting(ttl_s=1.0)
    counting.update(table)
    assert counting.pop_expired(3.5) == [(0, 0), (1, 1), (2, 2)]
    assert visited == [0, 1, 2, 3]  # the first live room ends the walk: 996 rooms never looked at
    assert len(counting) == 997
