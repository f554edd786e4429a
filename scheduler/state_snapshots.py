"""Prefix caching for models with recurrent layers: which prompt prefixes have a state snapshot.

A recurrent layer (a convolution, a linear attention, a state-space model: workers/recurrent.py)
has no per-token KV to share: its state after a prefix is one fixed-size tensor per sequence. A
prefix hit on such a model must therefore find the blocks of its attention layers AND the
recurrent state at the hit's end. The worker keeps `num_slots` snapshots of states; this exact
LRU decides which prefix each slot holds, keyed by the hash of the prefix's last block (a hash
chains every block before it, and the adapter: scheduler/block_hash.py).

What is kept: one snapshot per request, at the last block boundary before its last prompt token
(floor((prompt - 1) / block_size) blocks), taken while the step computing that boundary runs
(the worker cuts the sequence there: workers/recurrent.py, run_mixer). A later request with the
same prompt, or one that extends it, hits that many blocks; a shorter shared prefix (a system
prompt followed by different questions) hits only if some request's snapshot ends exactly
there. Each snapshot costs one sequence's state (ModelInfo.kv_cache_kind says how many bytes).

The scheduler reserves a slot when it schedules the save, so a step decided ahead (while the
saving step runs) already finds it: the worker runs steps in order, the save first.
"""

from __future__ import annotations

from collections import OrderedDict

from scheduler.block_hash import BlockHash


class StateSnapshots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self.free = list(range(num_slots - 1, -1, -1))
        self.num_saves = 0
        self.num_evictions = 0

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding the state after the prefix ending in this block (now the most recently used)."""
        slot = self.slot_of.get(block_hash)
        if slot is not None:
            self.slot_of.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for the state after this prefix, the least recently used one's if none is free;
        None when the prefix already has one, or there are no slots."""
        if block_hash in self.slot_of or self.num_slots == 0:
            return None
        if self.free:
            slot = self.free.pop()
        else:
            _, slot = self.slot_of.popitem(last=False)
            self.num_evictions += 1
        self.slot_of[block_hash] = slot
        self.num_saves += 1
        return slot

    def clear(self) -> None:
        self.slot_of.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))
