"""What the random-order tests of the P/D roles share (test_decode_orders.py, test_prefill_orders.py):
run one seeded order of events to its end, optionally with the mutation that skips one free."""

from __future__ import annotations

import asyncio


async def run(order, num_events: int, skip_a_free: bool = False):
    """`order` (event(), settle(), check(), core) driven through `num_events` events, settled and
    checked. With `skip_a_free`, the engine's first `release` (blocks held or quarantined going back)
    does nothing; `order.skipped` counts the releases asked for."""
    order.skipped = 0
    if skip_a_free:
        release = order.core.release

        def release_but_the_first(request_id: str) -> bool:
            order.skipped += 1
            return order.skipped == 1 or release(request_id)
        order.core.release = release_but_the_first
    for _ in range(num_events):
        await order.event()
    await order.settle()
    order.check()
    return order


def count_caught(make_order, num_orders: int, num_events: int) -> tuple[int, int]:
    """(orders whose checks failed under the mutation, orders that released anything at all)."""
    caught = released = 0
    for seed in range(num_orders):
        order = make_order(seed)
        try:
            asyncio.run(run(order, num_events, skip_a_free=True))
        except AssertionError:
            caught += 1
        released += order.skipped > 0
    return caught, released
