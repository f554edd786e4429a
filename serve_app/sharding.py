"""ShardedEngineClient: one EngineClient over several scheduler shards (num_scheduler_shards > 1).

A request goes to the shard `scheduler.sharding.shard_of` picks from its first prompt
block(s); abort() follows the request to its shard (remembered for the last
NUM_REMEMBERED_OWNERS requests, else sent to every shard). status() merges the shards'
statuses: counts add up, seconds_since_last_step is the worst, so /health is not ready if
any shard is stuck, and a shard that cannot answer fails the whole status call.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

from serve_app.engine_client import EngineClient, EngineStatus
from scheduler.outputs import EngineRequest, RequestOutput
from scheduler.sharding import shard_of

NUM_REMEMBERED_OWNERS = 65536  # request id -> shard, most recent requests


class ShardedEngineClient:
    def __init__(self, shards: Sequence[EngineClient], block_size: int, num_hash_blocks: int = 1) -> None:
        assert shards, "at least one shard"
        self.shards = list(shards)  # shard index -> its client
        self.block_size = block_size  # tokens per KV block, as the schedulers'
        self.num_hash_blocks = num_hash_blocks  # leading blocks hashed to pick a shard
        self._owner: OrderedDict[str, int] = OrderedDict()  # request id -> shard index

    def shard_for(self, prompt_token_ids: Sequence[int]) -> int:
        return shard_of(prompt_token_ids, self.block_size, len(self.shards), self.num_hash_blocks)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        shard = self.shard_for(request.prompt_token_ids)
        self._owner[request.request_id] = shard  # now, so an abort before the first read finds it
        self._owner.move_to_end(request.request_id)
        while len(self._owner) > NUM_REMEMBERED_OWNERS:
            self._owner.popitem(last=False)
        return self.shards[shard].generate(request)

    def abort(self, request_id: str) -> None:
        shard = self._owner.get(request_id)
        for index in range(len(self.shards)) if shard is None else (shard,):
            self.shards[index].abort(request_id)

    async def status(self) -> EngineStatus:
        return merge_statuses(await asyncio.gather(*(shard.status() for shard in self.shards)))

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Every shard serves the adapter, or none: a shard's refusal unloads it from those before."""
        results = []
        for index, shard in enumerate(self.shards):
            try:
                results.append(await shard.load_lora(name, path))
            except BaseException:
                for done in self.shards[:index]:
                    await done.unload_lora(name)
                raise
        return results[0]

    async def unload_lora(self, name: str) -> dict[str, Any]:
        results = [await shard.unload_lora(name) for shard in self.shards]
        return results[0]


def merge_statuses(statuses: Sequence[Any]) -> Any:
    """One status of the same dataclass type: numbers summed, the worst time since a step."""
    first = statuses[0]
    merged: dict[str, Any] = {}
    for field in dataclasses.fields(first):
        values = [getattr(status, field.name) for status in statuses]
        if field.name.startswith("seconds_"):
            known = [value for value in values if value is not None]
            merged[field.name] = max(known) if known else None
        elif all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
            merged[field.name] = sum(values)
        else:
            merged[field.name] = values[0]
    return dataclasses.replace(first, **merged)
