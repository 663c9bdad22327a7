"""`n > 1` forks a request into children: ids, seeds and, on a P/D pair, bootstrap rooms."""

from disagg.api.parallel import child_msgs, child_room
from disagg.types import SamplingParams
from disagg.wire.engine_msgs import GenerateMsg


def test_children_ids_seeds_and_rooms():
    msg = GenerateMsg("req", SamplingParams(max_tokens=2, seed=7), prompt="p", bootstrap_room=2**63 - 2,
                      bootstrap_host="h", bootstrap_port=1)
    children = child_msgs(msg, 3)
    assert [(c.request_id, c.sampling.seed, c.bootstrap_room) for c in children] == [
        ("0_req", 7, 2**63 - 2), ("1_req", 8, 2**63 - 1), ("2_req", 9, 0)]  # rooms wrap within 63 bits
    assert {(c.bootstrap_host, c.bootstrap_port, c.prompt) for c in children} == {("h", 1, "p")}
    unified = child_msgs(GenerateMsg("u", SamplingParams(max_tokens=2), prompt="p"), 2)
    assert [(c.request_id, c.sampling.seed, c.bootstrap_room) for c in unified] == [("0_u", None, None), ("1_u", None, None)]
    assert [child_room(10, i) for i in range(3)] == [10, 11, 12]
