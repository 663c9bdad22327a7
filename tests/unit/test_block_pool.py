from disagg.engine.block_pool import BlockPool


def test_allocate_pops_in_order_and_free_appends_in_given_order():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.free_block_ids() == [3, 4, 5]
    pool.free([2, 0])
    assert pool.free_block_ids() == [3, 4, 5, 2, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 0, 0, 0, 0]
    pool.check_integrity()


def test_cached_block_is_found_until_evicted_by_reallocation():
    pool = BlockPool(3)
    [a] = pool.allocate(1)
    pool.cache(a, 111)
    pool.free([a])
    assert pool.lookup(111) == 0  # still cached while free
    assert pool.allocate(2) == [1, 2]  # block 0 is last in the free queue: not evicted yet
    assert pool.lookup(111) == 0
    assert pool.allocate(1) == [0]  # evicted now
    assert pool.lookup(111) is None
    assert pool.blocks[0].block_hash is None
    pool.check_integrity()


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(4)
    [a] = pool.allocate(1)
    pool.cache(a, 7)
    pool.free([a])
    assert pool.num_free_blocks == 4
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 1
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 2
    pool.free([a])
    pool.free([a])
    assert pool.free_block_ids() == [1, 2, 3, 0]
    pool.check_integrity()


def test_double_free_is_caught():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.free([a])
    try:
        pool.free([a])
    except AssertionError as e:
        # pytest rewrites disagg's asserts too (its pytest11 entry point): the message is the first line
        assert str(e).splitlines()[0] == "block 0 freed twice"
    else:
        raise AssertionError("double free not detected")


def test_reset_prefix_cache_refused_while_blocks_are_used():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.cache(a, 5)
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(5) == 0
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(5) is None
    pool.check_integrity()


def test_caching_disabled_never_finds_anything():
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    pool.cache(a, 9)
    assert pool.lookup(9) is None
