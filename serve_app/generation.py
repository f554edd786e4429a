"""Driving engine requests: deltas in, ChoiceDeltas out, aborts guaranteed.

An engine request is aborted (its KV blocks freed at once) whenever we stop reading it
before the engine has finished every sequence: a stop string ended all its choices, the
client went away (the handler task is cancelled), or an error was raised. abort() is
synchronous and fire-and-forget, so it is safe in the finally block of a cancelled task.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from serve_app.choice_tracker import ChoiceDelta, RequestTracker
from serve_app.engine_client import EngineClient
from scheduler.outputs import EngineRequest, TokenLogprobs

T = TypeVar("T")


async def stream_choices(
    engine: EngineClient, request: EngineRequest, tracker: RequestTracker
) -> AsyncIterator[ChoiceDelta]:
    """ChoiceDeltas of one engine request until all its choices have finished."""
    outputs = engine.generate(request)
    try:
        async for output in outputs:
            delta = tracker.update(output)
            if delta is not None:
                yield delta
            if tracker.finished:
                break
    finally:
        if not tracker.engine_done:
            engine.abort(request.request_id)
        with contextlib.suppress(Exception):
            await _close(outputs)


async def _close(iterator: AsyncIterator[object]) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """Items of several async iterators as they come; closing this closes them all."""
    if len(iterators) == 1:
        async with contextlib.aclosing(iterators[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[tuple[bool, object]] = asyncio.Queue()

    async def pump(iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put((False, item))
        except Exception as error:  # forwarded to the consumer; CancelledError is not caught
            await queue.put((True, error))
            return
        finally:
            await _close(iterator)
        await queue.put((True, None))

    tasks = [asyncio.create_task(pump(iterator)) for iterator in iterators]
    try:
        num_open = len(tasks)
        while num_open:
            done, item = await queue.get()
            if not done:
                yield item  # type: ignore[misc]
                continue
            num_open -= 1
            if item is not None:
                raise item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class GenerationRun:
    """The engine requests of one HTTP request (one per prompt), their trackers, usage."""

    def __init__(
        self,
        response_id: str,
        engine: EngineClient,
        requests: list[EngineRequest],
        trackers: list[RequestTracker],
    ) -> None:
        assert len(requests) == len(trackers)
        self.response_id = response_id  # the id the client sees ("cmpl-...", "chatcmpl-...")
        self._engine = engine
        self._requests = requests
        self.trackers = trackers

    @property
    def num_choices(self) -> int:
        return sum(len(tracker.choices) for tracker in self.trackers)

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        streams = [
            stream_choices(self._engine, request, tracker)
            for request, tracker in zip(self._requests, self.trackers)
        ]
        return merge(streams)

    async def collect(self) -> list[ChoiceResult]:
        """Runs to the end; one result per choice, by choice index."""
        results = [ChoiceResult(index) for index in range(self.num_choices)]
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for delta in deltas:
                results[delta.index].add(delta)
        return results

    def usage(self) -> dict[str, object]:
        num_prompt_tokens = sum(len(tracker.prompt_token_ids) for tracker in self.trackers)
        num_output_tokens = sum(
            choice.num_output_tokens for tracker in self.trackers for choice in tracker.choices
        )
        return {
            "prompt_tokens": num_prompt_tokens,
            "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {
                "cached_tokens": sum(tracker.num_cached_tokens for tracker in self.trackers)
            },
        }


class ChoiceResult:
    """A whole choice, accumulated from its deltas (non-streaming responses)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._text_parts: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self._text_parts)

    def add(self, delta: ChoiceDelta) -> None:
        self._text_parts.append(delta.text)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
