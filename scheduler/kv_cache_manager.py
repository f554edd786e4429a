"""Per-request block tables over one worker's BlockPool, with prefix caching and forking.

Token regions of one request: block_size 4, 14 known tokens, a 4-token prefix hit on
admission, 6 tokens computed so far (hit included), 5 scheduled this step:

    position:     0  1  2  3 |  4  5  6  7 |  8  9 10 11 | 12 13
    region:       h  h  h  h |  c  c  s  s |  s  s  s  . |  .  .
    block table: [    b7     ][    b2      ][    b9      ]
                  hit: shared,  held          new this step
                  registered

    h prefix hit, c computed earlier, s scheduled now, . not yet (no block needed yet)

    num_required_blocks = ceil((num_computed_tokens + num_new_tokens) / block_size)
                        = ceil((6 + 5) / 4) = 3
    num_new_blocks      = num_required_blocks - blocks held (hits included) = 3 - 2 = 1

- A prefix hit covers full blocks only, and never the whole token list: at least the last
  token is computed so that its logits exist (max hit = (num_tokens - 1) // block_size
  blocks).
- A block enters the prefix cache (gets its hash registered) only once all its tokens are
  computed, i.e. after the step that computed them: `cache_computed_blocks`.
- Fork (n>1): a child shares the parent's full computed blocks by reference and gets a
  private copy of the parent's last, partial block: (src, dst) goes to copy_blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scheduler.block_hash import BlockHash
from scheduler.block_pool import BlockPool, KVBlock
from scheduler.request import Request


@dataclass(slots=True)
class ComputedBlocks:
    """A prefix hit: blocks whose KV is already in the pool."""

    blocks: list[KVBlock]  # block-table order, all full and registered
    num_tokens: int  # tokens covered: len(blocks) * block_size


@dataclass(slots=True)
class Allocation:
    new_block_ids: list[int]  # blocks appended to the request's table, in table order


@dataclass(slots=True)
class ForkResult:
    block_ids: list[int]  # the child's whole block table
    copy: tuple[int, int] | None  # (src, dst): the parent's partial last block -> the child's copy


@dataclass(slots=True)
class KVUsage:
    num_used_blocks: int  # blocks referenced by requests
    num_usable_blocks: int  # all blocks but the null block
    num_cached_blocks: int  # blocks registered in the prefix cache (used or free)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size  # tokens per block
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}  # request_id -> block table
        self.num_registered: dict[str, int] = {}  # request_id -> leading blocks in the prefix cache

    # --- lookups (no side effects) ---------------------------------------------------
    def get_computed_blocks(
        self, request: Request, landing: Mapping[BlockHash, KVBlock] | None = None
    ) -> ComputedBlocks:
        """The longest cached prefix of `request`, at least one token short of its target.

        `landing`: blocks that other requests hold, uncached, whose tokens the step in flight
        computes (blocks_filled_by). Deciding the step after it, they count as cached: the
        worker runs that step first. They are registered when it lands, by their owner."""
        if not self.enable_prefix_caching:
            return ComputedBlocks([], 0)
        max_blocks = (request.num_tokens_to_compute - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None and landing:
                block = landing.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return ComputedBlocks(blocks, len(blocks) * self.block_size)

    def blocks_filled_by(self, request: Request, num_computed_tokens: int) -> dict[BlockHash, KVBlock]:
        """The request's held, uncached full blocks whose tokens all lie below num_computed_tokens:
        those the step in flight fills, when num_computed_tokens counts its tokens."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        hashes = request.block_hashes
        return {hashes[i]: blocks[i] for i in range(self.num_registered.get(rid, 0), num_full)}

    def uncached_hashes(self, request: Request) -> Sequence[BlockHash]:
        """Hashes of the request's full blocks that it holds and that are not registered yet:
        their tokens are scheduled and not computed yet."""
        rid = request.request_id
        return request.block_hashes[self.num_registered.get(rid, 0):len(self.req_blocks.get(rid, ()))]

    def num_matched_tokens(self, block_hashes: Sequence[BlockHash]) -> int:
        """Tokens of the longest cached prefix (full blocks), without allocating: for routing."""
        num = 0
        for block_hash in block_hashes:
            if self.pool.lookup(block_hash) is None:
                break
            num += 1
        return num * self.block_size

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_blocks_to_grow(self, request_id: str, num_tokens: int) -> int:
        """Blocks a running request must add to hold `num_tokens` tokens (0 if it has them)."""
        return max(0, self._num_blocks_for(num_tokens) - len(self.req_blocks[request_id]))

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> KVUsage:
        return KVUsage(self.pool.num_used_blocks, self.pool.num_usable_blocks, len(self.pool.cached))

    # --- mutations ---------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> Allocation | None:
        """Blocks for `num_new_tokens` more tokens (and a prefix hit on admission), or None.

        None means "does not fit": nothing changed, the caller may preempt and retry.
        """
        blocks = self.req_blocks.get(request.request_id)
        if computed is None and blocks is not None:
            return self._grow(blocks, request.num_computed_tokens + num_new_tokens)
        hit = computed.blocks if computed is not None else []
        assert not (hit and blocks), f"{request.request_id}: a prefix hit on a request holding blocks"
        num_computed = request.num_computed_tokens + (computed.num_tokens if computed else 0)
        num_required = self._num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = max(0, num_required - len(hit) - (len(blocks) if blocks else 0))
        num_revived = sum(1 for b in hit if b.ref_cnt == 0)  # leave the free list on touch
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return None
        if blocks is None:
            blocks = self.req_blocks[request.request_id] = []
            self.num_registered[request.request_id] = 0
        if hit:
            self.pool.touch(hit)
            blocks.extend(hit)
            self.num_registered[request.request_id] = len(hit)
        return self._grow(blocks, num_computed + num_new_tokens)

    def _grow(self, blocks: list[KVBlock], num_tokens: int) -> Allocation | None:
        """Appends blocks until `blocks` holds `num_tokens` tokens (the hot path: decodes)."""
        num_new_blocks = self._num_blocks_for(num_tokens) - len(blocks)
        if num_new_blocks <= 0:
            return Allocation([])
        new_blocks = self.pool.allocate(num_new_blocks)
        if new_blocks is None:
            return None
        blocks.extend(new_blocks)
        return Allocation([b.block_id for b in new_blocks])

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= self.num_registered[rid]:
            return  # no block filled up this step (the common case)
        hashes = request.block_hashes
        num_full = min(num_full, len(hashes))
        blocks = self.req_blocks[rid]
        for i in range(self.num_registered[rid], num_full):
            if blocks[i].block_hash is None:
                self.pool.register(blocks[i], hashes[i])
        if num_full > self.num_registered[rid]:
            self.num_registered[rid] = num_full

    def fork(self, parent: Request, child: Request) -> ForkResult | None:
        """Gives `child` the parent's computed prefix: shared full blocks + a private partial copy."""
        assert parent.num_computed_tokens == parent.num_tokens_to_compute, parent.request_id
        assert child.request_id not in self.req_blocks, child.request_id
        parent_blocks = self.req_blocks[parent.request_id]
        num_full, partial = divmod(parent.num_computed_tokens, self.block_size)
        copy_dst: list[KVBlock] = []
        if partial:
            allocated = self.pool.allocate(1)
            if allocated is None:
                return None
            copy_dst = allocated
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        self.req_blocks[child.request_id] = shared + copy_dst
        self.num_registered[child.request_id] = min(num_full, self.num_registered[parent.request_id])
        copy = (parent_blocks[num_full].block_id, copy_dst[0].block_id) if partial else None
        return ForkResult(self.block_ids(child.request_id), copy)

    def free(self, request: Request) -> None:
        """Drops the request's references, last block first (so prefixes are evicted last)."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.num_registered.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def reset(self) -> None:
        """The worker lost its KV: forget every block table and the whole prefix cache."""
        self.req_blocks.clear()
        self.num_registered.clear()
        self.pool.reset()
