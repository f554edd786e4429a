"""KVCacheManager: exact block ids for allocation, prefix hits, eviction, fork and free."""

from scheduler.block_hash import BlockHasher
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams

BS = 4


def make(rid, prompt, n=1):
    return Request(rid, rid, list(prompt), SamplingParams(n=n), BlockHasher(BS))


def admit(kv, req, num_new=None):
    """Allocates like the scheduler does on admission and marks it computed."""
    computed = kv.get_computed_blocks(req)
    num_new = req.num_tokens_to_compute - computed.num_tokens if num_new is None else num_new
    alloc = kv.allocate_slots(req, num_new, computed)
    assert alloc is not None
    req.num_computed_tokens = computed.num_tokens + num_new
    kv.cache_computed_blocks(req)
    return computed, alloc


def refs(kv, block_ids):
    return [kv.pool.blocks[i].ref_cnt for i in block_ids]


def test_allocate_exact_ids_and_none_when_short():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make("a", range(10))
    assert kv.allocate_slots(a, 10).new_block_ids == [1, 2, 3]
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2).new_block_ids == []  # fits in block 3
    assert kv.allocate_slots(a, 3).new_block_ids == [4]
    b = make("b", range(100, 110))
    assert kv.allocate_slots(b, 10) is None  # 3 needed, 1 free
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1


def test_prefix_hit_shares_full_blocks_and_is_block_rounded():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make("a", range(10))
    admit(kv, a)
    assert kv.block_ids("a") == [1, 2, 3]
    b = make("b", list(range(9)) + [99, 98])  # shares 9 tokens = 2 full blocks
    computed, alloc = admit(kv, b)
    assert computed.num_tokens == 8 and [x.block_id for x in computed.blocks] == [1, 2]
    assert alloc.new_block_ids == [4]
    assert kv.block_ids("b") == [1, 2, 4]
    assert refs(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]


def test_hit_never_covers_the_whole_prompt():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make("a", range(8)))
    same = make("b", range(8))  # 2 full blocks cached, but the last token must be computed
    assert kv.get_computed_blocks(same).num_tokens == 4
    longer = make("c", range(9))
    assert kv.get_computed_blocks(longer).num_tokens == 8


def test_blocks_are_cached_only_once_computed():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make("a", range(12))
    assert kv.allocate_slots(a, 6).new_block_ids == [1, 2]  # first chunk: 6 tokens
    a.num_computed_tokens = 6
    kv.cache_computed_blocks(a)
    assert kv.num_matched_tokens(a.block_hashes) == 4  # block 2 is half computed
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 12
    kv.cache_computed_blocks(a)
    assert kv.num_matched_tokens(a.block_hashes) == 12


def test_free_tail_first_then_evict_lru_and_lazy_hit():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = make("a", range(12)), make("b", range(50, 62))
    admit(kv, a)
    admit(kv, b)
    assert kv.block_ids("a") == [1, 2, 3] and kv.block_ids("b") == [4, 5, 6]
    kv.free(a)
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == [7, 3, 2, 1, 6, 5, 4]
    # a's prefix is still cached although free: a hit revives it without a scan.
    a2 = make("a2", list(range(12)) + [0])
    computed, alloc = admit(kv, a2)
    assert computed.num_tokens == 12 and kv.block_ids("a2") == [1, 2, 3, 7]
    assert kv.pool.free_queue.block_ids() == [6, 5, 4]
    # The next allocation evicts b's tail block first; b keeps its first two blocks cached.
    c = make("c", range(200, 204))
    admit(kv, c)
    assert kv.block_ids("c") == [6]
    assert kv.num_matched_tokens(b.block_hashes) == 8


def test_revived_hits_count_against_free_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make("a", range(8))
    admit(kv, a)
    kv.free(a)  # blocks 1, 2 free but cached; free list [3, 2, 1]
    b = make("b", list(range(8)) + [1, 2, 3, 4, 5])  # hits 2 blocks, needs 2 more: 4 > 3
    computed = kv.get_computed_blocks(b)
    assert computed.num_tokens == 8
    assert kv.allocate_slots(b, 5, computed) is None
    assert kv.pool.free_queue.block_ids() == [3, 2, 1] and refs(kv, [1, 2]) == [0, 0]


def test_fork_shares_full_blocks_and_copies_partial():
    kv = KVCacheManager(num_blocks=12, block_size=BS)
    parent = make("p", range(10), n=2)  # computes 9 tokens: blocks [1, 2, 3(partial)]
    admit(kv, parent)
    assert kv.block_ids("p") == [1, 2, 3] and parent.num_computed_tokens == 9
    c0, c1 = parent.make_fork_child(0), parent.make_fork_child(1)
    r0, r1 = kv.fork(parent, c0), kv.fork(parent, c1)
    assert (r0.block_ids, r0.copy) == ([1, 2, 4], (3, 4))
    assert (r1.block_ids, r1.copy) == ([1, 2, 5], (3, 5))
    assert refs(kv, [1, 2, 3, 4, 5]) == [3, 3, 1, 1, 1]
    kv.free(parent)
    assert refs(kv, [1, 2, 3]) == [2, 2, 0]
    kv.free(c0)  # finish / abort of one child
    assert refs(kv, [1, 2, 4, 5]) == [1, 1, 0, 1]
    assert kv.pool.free_queue.block_ids()[-2:] == [3, 4]
    kv.free(c1)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    parent = make("p", range(9), n=2)  # computes 8 tokens: 2 full blocks
    admit(kv, parent)
    r = kv.fork(parent, parent.make_fork_child(0))
    assert (r.block_ids, r.copy) == ([1, 2], None)


def test_fork_returns_none_when_no_block_for_copy():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    parent = make("p", range(10), n=2)
    admit(kv, parent)  # 3 blocks: the pool is full
    assert kv.fork(parent, parent.make_fork_child(0)) is None
    assert refs(kv, [1, 2, 3]) == [1, 1, 1]


def test_matched_tokens_for_router_without_allocating():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    admit(kv, make("a", range(13)))
    hasher = BlockHasher(BS)
    assert kv.num_matched_tokens(hasher.hash_tokens(range(20))) == 12
    assert kv.num_matched_tokens(hasher.hash_tokens([0, 1, 2, 3, 9, 9, 9, 9])) == 4
    assert kv.num_matched_tokens(hasher.hash_tokens([5] * 8)) == 0
    assert kv.usage().num_used_blocks == 4


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    admit(kv, make("a", range(12)))
    assert kv.get_computed_blocks(make("b", range(12))).num_tokens == 0
    assert kv.num_matched_tokens(BlockHasher(BS).hash_tokens(range(12))) == 0


def test_uncached_hashes_are_the_full_blocks_held_but_not_computed_yet():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make("a", range(14))  # 3 full blocks and a partial one
    assert kv.uncached_hashes(a) == []  # holds nothing
    kv.allocate_slots(a, 9)  # 3 blocks for the first 9 tokens
    assert kv.uncached_hashes(a) == a.block_hashes[:3]
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)  # blocks 0 and 1 are full and computed
    assert kv.uncached_hashes(a) == a.block_hashes[2:3]
    kv.allocate_slots(a, 5)  # the rest: the 4th block is partial, so it has no hash
    assert kv.uncached_hashes(a) == a.block_hashes[2:3]


def test_blocks_filled_by_the_step_in_flight_count_as_a_hit_when_passed_as_landing():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make("a", range(14))
    kv.allocate_slots(a, 9)  # the step in flight computes tokens 0-8: blocks 0 and 1 full, 2 not
    landing = kv.blocks_filled_by(a, 9)
    assert list(landing) == a.block_hashes[:2] and [b.block_id for b in landing.values()] == kv.block_ids("a")[:2]
    follower = make("f", list(range(12)) + [99])
    assert kv.get_computed_blocks(follower).num_tokens == 0  # nothing is cached yet
    computed = kv.get_computed_blocks(follower, landing)
    assert computed.num_tokens == 8
    kv.allocate_slots(follower, 5, computed)
    assert kv.block_ids("f")[:2] == kv.block_ids("a")[:2] and refs(kv, kv.block_ids("a")[:2]) == [2, 2]
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)  # the step lands: the owner registers them
    assert kv.get_computed_blocks(make("g", list(range(12)) + [98])).num_tokens == 8
