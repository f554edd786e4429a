"""Chained, typed, collision-safe hashes over FULL blocks of token ids.

Block i's hash covers the whole prefix [0, (i + 1) * block_size): it is a strong hash of
(block i-1's hash, block i's token ids). Equal hashes therefore mean equal prefixes, up to a
sha256 collision, so a hit needs no token check. Only full blocks are hashed: a partial last
block has no hash and is never shared through the prefix cache.

    token_ids: [ t0 .. t15 | t16 .. t31 | t32 .. t40 ]      block_size = 16
    hashes:    [    h0     |     h1     ]                   h1 = H(h0, t16..t31)
                                          (partial: no hash)

The hash depends only on the token ids, the block size and the root (block 0's parent), so
every worker's KV manager agrees on it: the router hashes a prompt once and asks each worker
for its matched length. A request for a LoRA adapter starts from its adapter's root
(`adapter_root`): the same tokens under another adapter have other keys and values, and so
other hashes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

# (parent block hash or None for block 0, the block's token ids) -> the block's hash
HashFn = Callable[["BlockHash | None", Sequence[int]], BlockHash]

_ROOT = b"rayllm-kv-root"  # parent of block 0


def adapter_root(lora_name: str | None, lora_path: str | None = None) -> BlockHash | None:
    """Block 0's parent for a request of this LoRA adapter (None: the base model's). The path
    is part of it: a name unloaded and loaded again from another directory is another adapter."""
    if lora_name is None:
        return None
    key = lora_name if lora_path is None else f"{lora_name}\0{lora_path}"
    return BlockHash(hashlib.sha256(b"rayllm-kv-lora:" + key.encode()).digest())


def sha256_block_hash(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The default HashFn: sha256 over parent hash + token ids as int64."""
    h = hashlib.sha256(_ROOT if parent is None else parent)
    h.update(array("q", token_ids).tobytes())
    return BlockHash(h.digest())


class BlockHasher:
    """Hashes the full blocks of a growing token list, for one block size."""

    __slots__ = ("block_size", "hash_fn")

    def __init__(self, block_size: int, hash_fn: HashFn = sha256_block_hash) -> None:
        assert block_size >= 1, block_size
        self.block_size = block_size  # tokens per KV block
        self.hash_fn = hash_fn  # (parent hash, block token ids) -> block hash

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int], root: BlockHash | None = None) -> None:
        """Appends to `hashes` the hash of every full block of `token_ids` not hashed yet;
        block 0's parent is `root` (adapter_root; None: the base model's)."""
        bs = self.block_size
        num_full = len(token_ids) // bs
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i > 0 else root
            hashes.append(self.hash_fn(parent, token_ids[i * bs : (i + 1) * bs]))

    def hash_tokens(self, token_ids: Sequence[int], root: BlockHash | None = None) -> list[BlockHash]:
        """The hashes of every full block of `token_ids` (what the router matches on)."""
        hashes: list[BlockHash] = []
        self.extend(hashes, token_ids, root)
        return hashes

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BlockHasher)
            and other.block_size == self.block_size
            and other.hash_fn is self.hash_fn
        )

    def __hash__(self) -> int:
        return hash((self.block_size, id(self.hash_fn)))
