"""The KV block pool of one worker: ref counts, an LRU free list, lazy eviction.

Blocks are fixed-size pages of the worker's KV tensors, named by id. Block 0 is the null
block: reserved, never allocated, never freed (a worker may point padding slots at it).

Free list: an intrusive doubly linked list through the blocks themselves, so that taking a
cached block off the list when a prefix hit revives it costs O(1), not a scan.

    head <-> [b7] <-> [b3] <-> [b9] <-> ... <-> tail
             evicted first                 freed last

- allocate pops from the head (least recently freed first);
- free appends at the tail; a request frees its blocks tail first (last block first), so
  its prefix blocks, the ones most likely shared later, are evicted last;
- lazy eviction: a freed block keeps its hash and stays findable in `cached` until it is
  popped for reuse; only then is its hash dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.block_hash import BlockHash

NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int  # index into the worker's KV tensors
    ref_cnt: int = 0  # requests whose block table holds this block
    block_hash: BlockHash | None = None  # set while registered in the prefix cache
    prev_free: KVBlock | None = None  # free-list links; both None when not on the list
    next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation is O(1)."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(block_id=-1)  # sentinel, never handed out
        self._tail = KVBlock(block_id=-1)  # sentinel, never handed out
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0  # blocks on the list
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        assert block is not None and block is not self._tail, "free list is empty"
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, block
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not on the free list"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (evicted first) to tail: for tests and debugging."""
        ids = []
        block = self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Every block of one worker's pool, the free list, and the prefix-cache map."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2, "need the null block and at least one usable block"
        self.num_blocks = num_blocks  # including the null block
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]  # block_id -> block
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.null_block.ref_cnt = 1  # pinned forever
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVBlock] = {}  # block hash -> the block holding that prefix

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (including cached ones that would be evicted)."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests, in [0, 1]."""
        return self.num_used_blocks / self.num_usable_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Takes blocks off the head of the free list (evicting their hashes); None if short."""
        if num_blocks > self.free_queue.num_free:
            return None
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            assert block.ref_cnt == 0, block
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """A new reference to blocks (a prefix hit or a fork): revives free ones in O(1)."""
        for block in blocks:
            assert block.block_id != NULL_BLOCK_ID
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        """Drops one reference each; blocks reaching 0 go to the tail, in the given order."""
        for block in blocks_in_eviction_order:
            assert block.ref_cnt >= 1 and block.block_id != NULL_BLOCK_ID, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def register(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Enters a full, computed block into the prefix cache.

        False (and nothing changes) when another block already holds this prefix, e.g. two
        requests computed the same prompt side by side; this one then stays uncached.
        """
        assert block.ref_cnt >= 1 and block.block_hash is None, block
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset(self) -> None:
        """Forgets everything (the worker's KV is gone): all blocks free, no cache."""
        self.__init__(self.num_blocks)  # type: ignore[misc]

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            assert self.cached.get(block.block_hash) is block
            del self.cached[block.block_hash]
            block.block_hash = None
