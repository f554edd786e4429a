"""BlockPool and its intrusive LRU free list: exact ids and free-list order."""

from scheduler.block_hash import BlockHash
from scheduler.block_pool import NULL_BLOCK_ID, BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def test_null_block_is_reserved():
    pool = BlockPool(4)
    assert pool.num_usable_blocks == 3
    assert pool.free_queue.block_ids() == [1, 2, 3]
    assert ids(pool.allocate(3)) == [1, 2, 3]
    assert pool.allocate(1) is None
    assert pool.blocks[NULL_BLOCK_ID].ref_cnt == 1


def test_allocate_from_head_free_to_tail_in_given_order():
    pool = BlockPool(6)
    a = pool.allocate(2)
    assert ids(a) == [1, 2] and [b.ref_cnt for b in a] == [1, 1]
    assert pool.free_queue.block_ids() == [3, 4, 5]
    pool.free(reversed(a))  # a request frees its tail first
    assert pool.free_queue.block_ids() == [3, 4, 5, 2, 1]
    assert ids(pool.allocate(4)) == [3, 4, 5, 2]
    assert pool.free_queue.block_ids() == [1]
    assert pool.num_used_blocks == 4 and pool.usage == 0.8


def test_allocate_too_many_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(1)
    assert pool.allocate(3) is None
    assert pool.free_queue.block_ids() == [2, 3]
    assert pool.num_free_blocks == 2


def test_touch_revives_from_middle_of_free_list_and_counts_refs():
    pool = BlockPool(6)
    blocks = pool.allocate(5)
    pool.free(blocks)
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    b3 = pool.blocks[3]
    pool.touch([b3])
    assert b3.ref_cnt == 1 and pool.free_queue.block_ids() == [1, 2, 4, 5]
    pool.touch([b3])
    assert b3.ref_cnt == 2
    pool.free([b3])
    assert b3.ref_cnt == 1 and 3 not in pool.free_queue.block_ids()
    pool.free([b3])
    assert pool.free_queue.block_ids() == [1, 2, 4, 5, 3]


def test_lazy_eviction_keeps_hash_until_reuse():
    pool = BlockPool(4)
    b1, b2 = pool.allocate(2)
    h = BlockHash(b"h1")
    assert pool.register(b1, h)
    pool.free([b2, b1])
    assert pool.free_queue.block_ids() == [3, 2, 1]
    assert pool.lookup(h) is b1 and b1.block_hash == h  # freed, still findable
    assert ids(pool.allocate(2)) == [3, 2]
    assert pool.lookup(h) is b1
    assert ids(pool.allocate(1)) == [1]  # reused: the hash goes
    assert pool.lookup(h) is None and b1.block_hash is None


def test_register_duplicate_prefix_keeps_first_block():
    pool = BlockPool(4)
    b1, b2 = pool.allocate(2)
    h = BlockHash(b"same")
    assert pool.register(b1, h)
    assert not pool.register(b2, h)
    assert pool.lookup(h) is b1 and b2.block_hash is None


def test_reset_frees_everything_and_forgets_cache():
    pool = BlockPool(4)
    b1, _ = pool.allocate(2)
    pool.register(b1, BlockHash(b"x"))
    pool.reset()
    assert pool.free_queue.block_ids() == [1, 2, 3]
    assert pool.lookup(BlockHash(b"x")) is None
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
