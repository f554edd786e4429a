"""Driving engine requests: deltas in, ChoiceDeltas out, aborts guaranteed.

An engine request is aborted (its KV blocks freed at once) whenever we stop reading it
before the engine has finished every sequence: a stop string ended all its choices, the
client went away (the handler task is cancelled), its deadline passed, or an error was
raised. abort() is synchronous and fire-and-forget, so it is safe in the finally block of a
cancelled task.

GenerationRun.start() submits every engine request and waits for each one's first delta
before the route answers, so a refusal (400, 429 queue full, 503 draining or unavailable,
408/504 timeout with nothing generated) is an HTTP status, also for streams, never an error
event after a 200.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from serve_app.choice_tracker import ChoiceDelta, RequestTracker
from serve_app.engine_client import EngineClient
from serve_app.errors import OpenAIError
from serve_app.observability import observe_finish, observe_output
from scheduler.outputs import EngineRequest, TokenLogprobs

T = TypeVar("T")


TIMEOUT_FINISH_REASON = "timeout"


def request_timeout_error(status: int = 504) -> OpenAIError:
    """Nothing was generated before the deadline: 408 when the client's own `timeout` set it
    (its constraint, not a server fault), 504 when the server's default did."""
    return OpenAIError("the request timed out before any token was generated", status,
                       code="timeout", error_type="timeout_error")


async def stream_choices(
    engine: EngineClient, request: EngineRequest, tracker: RequestTracker, deadline: float | None = None,
    timeout_status: int = 504,
) -> AsyncIterator[ChoiceDelta]:
    """ChoiceDeltas of one engine request until all its choices have finished.

    deadline (event loop time): then unfinished choices end with finish_reason "timeout",
    or, when no token came at all, request_timeout_error() is raised.
    """
    outputs = engine.generate(request)
    try:
        while not tracker.finished:
            try:
                async with asyncio.timeout_at(deadline):
                    output = await anext(outputs)
            except StopAsyncIteration:
                break
            except TimeoutError:
                if tracker.num_output_tokens == 0:
                    raise request_timeout_error(timeout_status) from None
                for choice in tracker.choices:
                    final = choice.finish(TIMEOUT_FINISH_REASON)
                    if final is not None:
                        observe_finish(final)
                        yield final
                break
            delta = tracker.update(output)
            observe_output(output, delta)  # the HTTP request's record: tokens, worker, TTFT
            if delta is not None:
                yield delta
    finally:
        if not tracker.engine_done:
            engine.abort(request.request_id)
        with contextlib.suppress(Exception):
            await _close(outputs)


async def _close(iterator: AsyncIterator[object]) -> None:
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


async def prime(iterator: AsyncIterator[T]) -> AsyncIterator[T]:
    """Waits for the iterator's first item now (its errors raise here); returns an iterator
    over every item, the first included. Closing either closes the original."""
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        return _chain([], iterator)
    except BaseException:
        with contextlib.suppress(Exception):
            await _close(iterator)
        raise
    return _chain([first], iterator)


async def _chain(head: list[T], iterator: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        for item in head:
            yield item
        async for item in iterator:
            yield item
    finally:
        await _close(iterator)


async def coalesce(deltas: AsyncIterator[ChoiceDelta], interval: int) -> AsyncIterator[ChoiceDelta]:
    """Each choice's deltas in chunks of at least `interval` tokens (vLLM's --stream-interval):
    a choice's first delta and its final one go out at once, the ones between are held and
    merged until `interval` tokens have come since the last one sent. Fewer chunks per token:
    less CPU in the ingress and the proxy per streamed token, at the cost of smoothness (a
    client sees `interval` tokens at a time). For interval 1, use the deltas as they are
    (GenerationRun.deltas does): no layer is needed."""
    assert interval > 1, interval
    held: dict[int, list[ChoiceDelta]] = {}  # choice index -> deltas not sent yet, in order
    held_tokens: dict[int, int] = {}  # choice index -> tokens in them
    started: set[int] = set()  # choices whose first delta was sent
    async with contextlib.aclosing(deltas) as every:  # type: ignore[type-var]
        try:
            async for delta in every:
                index = delta.index
                parts = held.setdefault(index, [])
                parts.append(delta)
                held_tokens[index] = held_tokens.get(index, 0) + len(delta.token_ids)
                if index not in started or delta.finish_reason is not None or held_tokens[index] >= interval:
                    started.add(index)
                    del held[index], held_tokens[index]
                    yield join_deltas(parts)
        except Exception:  # the stream failed: what was held goes out before the error, as at interval 1
            for parts in held.values():
                yield join_deltas(parts)
            raise


def join_deltas(parts: list[ChoiceDelta]) -> ChoiceDelta:
    """One delta carrying a choice's consecutive deltas, in order."""
    if len(parts) == 1:
        return parts[0]
    logprobs = None
    if any(part.logprobs is not None for part in parts):
        logprobs = [entry for part in parts for entry in (part.logprobs or [])]
        assert len(logprobs) == sum(len(part.token_ids) for part in parts), "logprobs out of step with tokens"
    return ChoiceDelta(parts[-1].index, "".join(part.text for part in parts),
                       [token for part in parts for token in part.token_ids], logprobs, parts[-1].finish_reason)


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
        timeout_s: float | None = None,
        client_timeout: bool = False,
        stream_interval: int = 1,
    ) -> None:
        assert len(requests) == len(trackers)
        self.stream_interval = stream_interval  # tokens per streamed chunk at least (coalesce)
        self.response_id = response_id  # the id the client sees ("cmpl-...", "chatcmpl-...")
        self.model = ""  # the "model" its responses name: the served model's, or the LoRA adapter's
        self._engine = engine
        self._requests = requests
        self.trackers = trackers
        # event loop time at which unfinished choices end with "timeout"; None: no deadline
        self.deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        self.timeout_status = 408 if client_timeout else 504  # nothing generated by the deadline
        self._primed: list[AsyncIterator[ChoiceDelta]] | None = None  # set by start()

    @property
    def num_choices(self) -> int:
        return sum(len(tracker.choices) for tracker in self.trackers)

    async def start(self) -> None:
        """Submits every engine request and waits for each one's first delta (see module doc)."""
        streams = [
            stream_choices(self._engine, request, tracker, self.deadline, self.timeout_status)
            for request, tracker in zip(self._requests, self.trackers)
        ]
        results = await asyncio.gather(*(prime(stream) for stream in streams), return_exceptions=True)
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            for result in results:
                if not isinstance(result, BaseException):
                    await _close(result)
            raise errors[0]
        self._primed = results  # type: ignore[assignment]

    def deltas(self, coalesced: bool = True) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas as they come (continues start(), or starts now), in chunks of
        stream_interval tokens unless `coalesced` is False (whole responses need no chunks)."""
        streams, self._primed = self._primed, None
        if streams is None:
            streams = [
                stream_choices(self._engine, request, tracker, self.deadline, self.timeout_status)
                for request, tracker in zip(self._requests, self.trackers)
            ]
        merged = merge(streams)
        if not coalesced or self.stream_interval <= 1:  # no extra layer per delta
            return merged
        return coalesce(merged, self.stream_interval)

    async def collect(self) -> list[ChoiceResult]:
        """Runs to the end; one result per choice, by choice index."""
        results = [ChoiceResult(index) for index in range(self.num_choices)]
        async with contextlib.aclosing(self.deltas(coalesced=False)) as deltas:
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
