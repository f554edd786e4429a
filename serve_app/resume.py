"""ResumingEngineClient: an in-flight request survives a restart of the scheduler actor.

The ingress is the one place that knows, for each in-flight request, its prompt and every
token it has streamed to the client. When the scheduler actor dies (SchedulerGoneError from
the inner client), Ray restarts it (max_restarts) with no state; this client waits until it
answers (up to resume_timeout_s) and resubmits each unfinished sequence i as a new request

    EngineRequest(f"{id}@{attempt}" (n=1) or f"{id}@{attempt}.{i}" (n>1),
                  prompt_token_ids = the original prompt,
                  sampling_params  = the original (n=1) or params.for_child(i) (n>1),
                  output_token_ids = the tokens of sequence i streamed so far)

whose deltas are handed on as deltas of the original request and sequence. A failure at
submission (the scheduler is restarting) is retried the same way, at most max_resumes times
per request; then the error goes to the client (503, or an error event in a stream).

What holds after a resume (scheduler/outputs.py: a seeded token at output position p is drawn
from (seed, p) alone; the streamed tokens come back as OUTPUTS, not prompt):
- no duplicate and no missing token: the ingress's own record of what it streamed is the
  new request's starting point, so tokens the dead scheduler made but never delivered are
  made again, and nothing delivered is made twice;
- max_tokens, stop token ids, penalties (they see the resumed tokens as generated) and
  logprobs go on as if nothing happened;
- greedy and seeded sampling give the same tokens as a fault-free run, up to the
  floating-point effects of a different batch composition (equal on CPU fp32 in our tests);
  sequence i of an n>1 request keeps seed + i, its fork child's seed;
- unseeded sampling goes on without gap or duplicate, but its later tokens are a different
  random draw than a fault-free run's would have been (nothing can reproduce the shared
  generator's state);
- usage.prompt_tokens_details.cached_tokens reports the largest hit seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from serve_app.engine_client import EngineClient, EngineStatus
from serve_app.errors import SchedulerGoneError
from serve_app.generation import merge
from scheduler.outputs import EngineRequest, RequestOutput


class ResumingEngineClient:
    def __init__(self, inner: EngineClient, max_resumes: int = 3, resume_timeout_s: float = 60.0) -> None:
        self._inner = inner  # a RayEngineClient (wait_ready) or any EngineClient
        self.max_resumes = max_resumes  # resubmissions per request at most
        self.resume_timeout_s = resume_timeout_s  # how long to wait for the scheduler to answer again
        self.num_resumed_seqs = 0  # sequences resubmitted since start (for metrics)
        self._engine_ids: dict[str, list[str]] = {}  # client request id -> engine request ids streaming now

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        request_id, n = request.request_id, request.sampling_params.n
        tokens: list[list[int]] = [[] for _ in range(n)]  # sequence index -> tokens streamed
        finished: set[int] = set()  # sequence indexes whose final delta was streamed
        parts: dict[int | None, EngineRequest] = {None: request}  # sequence index (None: all) -> request
        attempt = 0
        try:
            while parts:
                self._engine_ids[request_id] = [part.request_id for part in parts.values()]
                try:
                    async for output in self._stream(parts):
                        tokens[output.index].extend(output.new_token_ids)
                        if output.finished:
                            finished.add(output.index)
                        yield dataclasses.replace(output, request_id=request_id)
                    return
                except SchedulerGoneError:
                    attempt += 1
                    if attempt > self.max_resumes:
                        raise
                    wait_ready = getattr(self._inner, "wait_ready", None)
                    if wait_ready is not None:
                        await wait_ready(self.resume_timeout_s)
                    parts = {
                        i: continuation(request, i, tokens[i], attempt) for i in range(n) if i not in finished
                    }
                    self.num_resumed_seqs += len(parts)
        finally:
            self._engine_ids.pop(request_id, None)

    def _stream(self, parts: dict[int | None, EngineRequest]) -> AsyncIterator[RequestOutput]:
        if None in parts:
            return self._inner.generate(parts[None])
        return merge([_reindexed(self._inner.generate(part), index) for index, part in parts.items()])

    def abort(self, request_id: str) -> None:
        for engine_id in self._engine_ids.get(request_id, [request_id]):
            self._inner.abort(engine_id)

    async def status(self) -> EngineStatus:
        return await self._inner.status()

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        return await self._inner.load_lora(name, path)

    async def unload_lora(self, name: str) -> dict[str, Any]:
        return await self._inner.unload_lora(name)


def continuation(request: EngineRequest, index: int, streamed: list[int], attempt: int) -> EngineRequest:
    """Sequence `index` of `request`, resubmitted after `streamed` tokens (see module doc)."""
    params = request.sampling_params
    if params.n == 1:
        return dataclasses.replace(request, request_id=f"{request.request_id}@{attempt}",
                                   output_token_ids=tuple(streamed), arrival_time=0.0)
    return dataclasses.replace(request, request_id=f"{request.request_id}@{attempt}.{index}",
                               sampling_params=params.for_child(index),
                               output_token_ids=tuple(streamed), arrival_time=0.0)


async def _reindexed(outputs: AsyncIterator[RequestOutput], index: int) -> AsyncIterator[RequestOutput]:
    try:
        async for output in outputs:
            yield dataclasses.replace(output, index=index)
    finally:
        close = getattr(outputs, "aclose", None)
        if close is not None:
            await close()
