"""Which scheduler shard takes a request: a stable hash of the prompt's first block(s). Pure.

One SchedulerActor owns every worker's block table, which makes routing exact; when that one
actor's event loop becomes the bottleneck (many workers, many short requests), the workers
are split into shards, each with its own SchedulerActor, and the ingress picks the shard:

    shard = sha256(prompt_token_ids[: num_hash_blocks * block_size]) mod num_shards

Requests that share their first block(s) (the same system prompt, the same few-shot header)
land on the same shard, so the shard's router can still keep their prefix warm on one worker.
The hash is sha256, not Python's hash(), so every ingress replica agrees. A prompt shorter
than the hashed span is hashed whole.

Knobs: num_shards (AppArgs.num_scheduler_shards), block_size (the KV block size), and
num_hash_blocks [1]: hash more blocks when every prompt starts with the same block (e.g. a
chat template's default system prompt), or everything would land on one shard.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def shard_of(prompt_token_ids: Sequence[int], block_size: int, num_shards: int, num_hash_blocks: int = 1) -> int:
    """The shard in [0, num_shards) for this prompt; the same prompt start always gets the same shard."""
    assert num_shards >= 1 and block_size >= 1 and num_hash_blocks >= 1, (num_shards, block_size, num_hash_blocks)
    if num_shards == 1:
        return 0
    head = list(prompt_token_ids[: num_hash_blocks * block_size])
    digest = hashlib.sha256(array("q", head).tobytes()).digest()
    return int.from_bytes(digest[:8], "little") % num_shards
