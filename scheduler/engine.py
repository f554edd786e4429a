"""The in-process engine: one Scheduler, one runner, an asyncio loop. No Ray, no globals.

    stream = engine.add_request(EngineRequest(...))   # from inside a running event loop
    async for delta in stream: ...                    # RequestOutput deltas, all n sequences

A background task runs `step()` while requests are unfinished and ends when none are left;
the next add_request starts it again. A step is schedule -> runner.execute -> update. A sync
`runner.execute` runs on the engine's single worker thread (the same thread every time,
which torch and CUDA prefer), so the event loop stays free to take requests and aborts while
the model runs; an `async def execute` (e.g. a Ray actor handle wrapper) is awaited directly.

The loop task runs in a fresh contextvars.Context, not in the context of the request that
happened to start it: it outlives that request, and Ray parents every call made in a
request's context to that request's task, so cancelling a disconnected client's call would
otherwise cancel the worker step of every request in the batch.

If the runner raises, the scheduler's state is reset (the worker's state is unknown) and,
by default, every unfinished request's stream gets the exception; the engine stays usable.
With `on_runner_error`, the caller decides instead: e.g. `take_for_migration()` here and
`adopt()` on an engine whose worker is alive, and the streams go on there.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.config import SchedulerConfig
from scheduler.outputs import (
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    RequestOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.stats import CumulativeStats, RequestStats, StatsSink, StepStats

logger = logging.getLogger(__name__)


class Runner(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


StreamListener = Callable[["RequestStream", "RequestOutput | BaseException"], None]


class RequestStream:
    """The deltas of one client request (every sequence of it), as an async iterator.

    Ends after each of the n sequences has had its final delta. `aclose()` aborts the
    request if it is still running (call it, or engine.abort, when the client goes away).

    With a `listener`, every delta (and a failure) is handed to it as it is put instead of
    queued for iteration: the Ray shell pushes them onto its ingress replica's output
    channel (scheduler/output_channel.py), so a step costs one message per replica.
    """

    def __init__(self, request_id: str, num_seqs: int, engine: Engine, arrival_time: float,
                 listener: StreamListener | None = None) -> None:
        self.request_id = request_id  # the client's id
        self.num_unfinished_seqs = num_seqs  # sequences without a final delta yet
        self.arrival_time = arrival_time  # seconds, engine clock
        self.first_token_time: float | None = None  # seconds, engine clock, first delta with tokens
        self.finish_time: float | None = None  # seconds, engine clock, last final delta
        self.scheduled_time: float | None = None  # seconds, engine clock, first scheduled for compute
        self.num_prompt_tokens = 0  # as the deltas report it
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache, as the deltas report it
        self.num_generation_tokens = 0  # tokens put, every sequence
        self.finish_reasons: list[str] = []  # one per finished sequence, in finishing order
        self._last_token_times: dict[int, float] = {}  # sequence index -> engine clock of its latest token
        self.engine = engine  # the engine that owns the request now (changes on migration)
        self.listener = listener  # (stream, delta or error); None: queued for `async for`
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._num_unread_finals = num_seqs  # final deltas not yet handed to the reader

    @property
    def finished(self) -> bool:
        return self.num_unfinished_seqs == 0

    def put(self, output: RequestOutput, now: float) -> float | None:
        """Queues the delta; returns the gap since the sequence's previous token (an
        inter-token latency), or None for a first token or a delta without tokens."""
        gap = None
        if output.new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
            previous = self._last_token_times.get(output.index)
            gap = None if previous is None else now - previous
            self._last_token_times[output.index] = now
            self.num_generation_tokens += len(output.new_token_ids)
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reasons.append(output.finish_reason.value)
            self.num_unfinished_seqs -= 1
            assert self.num_unfinished_seqs >= 0, self.request_id
            if self.num_unfinished_seqs == 0:
                self.finish_time = now
        self._hand_over(output)
        return gap

    def _hand_over(self, item: RequestOutput | BaseException) -> None:
        if self.listener is not None:
            self.listener(self, item)
        else:
            self._queue.put_nowait(item)

    def fail(self, error: BaseException) -> None:
        """Ends the stream with `error` (its unfinished sequences count as "error" in stats)."""
        self.finish_reasons.extend(["error"] * self.num_unfinished_seqs)
        self.num_unfinished_seqs = 0
        self.finish_time = self.engine.clock()
        self._hand_over(error)
        self.engine._report_finished(self)

    def stats(self, worker: str | None) -> RequestStats:
        """This request's stats (complete once it has finished)."""
        return RequestStats(
            request_id=self.request_id,
            worker=worker,
            finish_reasons=list(self.finish_reasons),
            num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=self.num_cached_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_seqs=len(self.finish_reasons) or 1,
            arrival_time=self.arrival_time,
            scheduled_time=self.scheduled_time,
            first_token_time=self.first_token_time,
            finish_time=self.finish_time if self.finish_time is not None else self.arrival_time,
        )

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._num_unread_finals == 0:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._num_unread_finals = 0
            raise item
        if item.finished:
            self._num_unread_finals -= 1
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.engine.abort(self.request_id)


@dataclass(slots=True)
class StepInFlight:
    """A step handed to the runner whose result is not applied yet."""

    scheduler_output: SchedulerOutput  # what the runner executes
    started: float  # engine clock, when scheduling began
    result: Awaitable[ModelRunnerOutput]  # the runner's answer (already running)
    landed: float | None = None  # engine clock, when the result was applied


@dataclass(slots=True)
class Migration:
    """Unfinished requests leaving an engine whose worker died, with their open streams."""

    requests: list[Request]  # reset for recompute, oldest first; they keep their tokens
    streams: dict[str, RequestStream]  # client request id -> its open stream


@dataclass(slots=True)
class SequenceResult:
    index: int  # sequence index within n
    token_ids: list[int]  # every generated token, the finishing one included
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprobs] | None  # aligned with token_ids, where asked


@dataclass(slots=True)
class GenerateResult:
    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache (block-rounded)
    sequences: list[SequenceResult] = field(default_factory=list)  # by index


class Engine:
    def __init__(
        self,
        config: SchedulerConfig,
        runner: Runner,
        eos_token_ids: Iterable[int] = (),
        clock: Callable[[], float] = time.monotonic,
        scheduler: Scheduler | None = None,
        on_runner_error: Callable[[Engine, Exception], None] | None = None,
        stats_sink: StatsSink | None = None,
        worker_label: str | None = None,
    ) -> None:
        self.config = config
        self.runner = runner  # execute(SchedulerOutput) -> ModelRunnerOutput, sync or async
        self.clock = clock  # seconds; arrival and stream timings
        self.scheduler = scheduler or Scheduler(config, eos_token_ids)
        self.on_runner_error = on_runner_error  # (engine, error); None: fail every open stream
        self.stats_sink = stats_sink  # gets StepStats and RequestStats; None: nobody listens
        self.worker_label = worker_label  # names this engine's worker in stats and output.worker
        self._streams: dict[str, RequestStream] = {}  # client request id -> open stream
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-runner")
        self._runner_is_async = inspect.iscoroutinefunction(runner.execute)
        self._loop_task: asyncio.Task[None] | None = None
        self._step_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None  # one step at a time, per loop
        self._next_id = 0  # for generate()'s request ids
        self._evacuating = False  # evacuate(): no step starts any more

    # --- requests ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest, listener: StreamListener | None = None) -> RequestStream:
        """Queues a request and returns its stream. Call from inside the event loop.

        listener: see RequestStream. Raises ValueError (from the scheduler) when the request
        can never run.
        """
        loop = asyncio.get_running_loop()  # raises outside a loop, before any state changes
        if request.arrival_time == 0.0:
            request = dataclasses.replace(request, arrival_time=self.clock())
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already streaming")
        self.scheduler.add_request(request)
        stream = RequestStream(request.request_id, request.sampling_params.n, self, request.arrival_time, listener)
        self._streams[request.request_id] = stream
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(self._run_loop(), context=contextvars.Context())
        return stream

    def abort(self, request_id: str) -> None:
        """Finishes the request now (its stream gets final abort deltas); unknown ids: no-op."""
        self._dispatch(self.scheduler.abort_request(request_id))

    @property
    def stats(self) -> CumulativeStats:
        return self.scheduler.totals.copy()

    @property
    def last_step_stats(self) -> StepStats | None:
        return self.scheduler.last_step_stats

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- the loop ---------------------------------------------------------------------------
    async def step(self) -> list[RequestOutput]:
        """One engine step; returns the deltas it produced (already sent to the streams)."""
        async with self._lock():
            try:
                flight = self._launch()
            except _SchedulerFailed:
                return []  # its streams got the error
            if flight is None:
                return []
            outputs = await self._land(flight)
            self._deliver(flight, outputs)
            return outputs

    def _lock(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._step_lock is None or self._step_lock[0] is not loop:
            self._step_lock = (loop, asyncio.Lock())  # generate() runs a new loop each call
        return self._step_lock[1]

    def _launch(self, ahead: bool = False) -> StepInFlight | None:
        """Schedules a step and hands it to the runner now; None when nothing can run.

        ahead: the last step is still running (Scheduler.schedule_ahead); None also when the
        next step must wait for its result."""
        started = self.clock()
        try:
            scheduler_output = self.scheduler.schedule_ahead() if ahead else self.scheduler.schedule()
        except Exception as error:
            self._scheduler_failed(error)
            raise _SchedulerFailed from error
        if scheduler_output.is_empty:
            return None
        self._mark_scheduled(scheduler_output, started)
        return StepInFlight(scheduler_output, started, self._start_execute(scheduler_output))

    async def _land(self, flight: StepInFlight) -> list[RequestOutput]:
        """Waits for the step's result and applies it to the scheduler (tokens, stops)."""
        try:
            runner_output = await flight.result
        except Exception as error:
            self._end_requests(error)
            raise
        flight.landed = self.clock()
        try:
            return self.scheduler.update_from_output(flight.scheduler_output, runner_output)
        except Exception as error:
            self._scheduler_failed(error)
            raise

    def _scheduler_failed(self, error: Exception) -> None:
        """The scheduler itself raised (a bug, not the runner): its state cannot be trusted, so
        its requests end as for a runner error on a live worker (their streams get the error,
        the KV accounting starts empty) and the engine goes on with new requests, instead of
        every later step failing on the half-updated state."""
        logger.error("engine %s: the scheduler failed; ending its %d requests with the error",
                     self.worker_label, len(self._streams), exc_info=error)
        self._end_requests(error)

    def _end_requests(self, error: Exception) -> None:
        """After a failed step: the group decides (migrate from a dead worker, or fail), else fail_all."""
        if self.on_runner_error is not None:
            self.on_runner_error(self, error)
        else:
            self.fail_all(error)

    def _deliver(self, flight: StepInFlight, outputs: list[RequestOutput]) -> None:
        """Sends a landed step's deltas to their streams and its stats to the sink."""
        inter_token_latencies = self._dispatch(outputs)
        step_stats = self.scheduler.last_step_stats
        if self.stats_sink is not None and step_stats is not None:
            duration = (flight.landed or self.clock()) - flight.started
            self.stats_sink.on_step(self.worker_label, step_stats, duration, inter_token_latencies)

    def _mark_scheduled(self, scheduler_output: SchedulerOutput, now: float) -> None:
        """Stamps the queue-time end of requests scheduled for the first time."""
        for new_request in scheduler_output.new_requests:
            request = self.scheduler.requests.get(new_request.request_id)
            stream = self._streams.get(request.client_request_id) if request is not None else None
            if stream is not None and stream.scheduled_time is None:
                stream.scheduled_time = now

    def _start_execute(self, scheduler_output: SchedulerOutput) -> Awaitable[ModelRunnerOutput]:
        """The runner starts on the step before this returns where it can: a runner with
        start() (TimedRunner: the Ray call is submitted at once) or a blocking one (its
        thread); a plain coroutine runner starts at the loop's next turn."""
        start = getattr(self.runner, "start", None)
        if start is not None:
            return start(scheduler_output)
        if self._runner_is_async:
            return asyncio.ensure_future(self.runner.execute(scheduler_output))  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, self.runner.execute, scheduler_output)

    async def _run_loop(self) -> None:
        """Steps while requests are unfinished, overlapping each step's output work with the
        next step's execution:

            land N (await its result, update) -> launch N+1 (schedule, submit) -> deliver N

        Delivering N (streams, the output channel, stats) needs none of N+1's tokens, so the
        worker already runs N+1 while it happens; N+1 is scheduled after N landed, so it sees
        every token, stop and free block of N (greedy and seeded outputs are unchanged).

        With config.async_scheduling, N+1 is decided and submitted before N lands
        (Scheduler.schedule_ahead), so the worker starts N+1 the moment N ends instead of
        after N's result has gone to the scheduler and N+1 has come back:

            launch N+1 ahead -> land N -> deliver N -> launch N+2 ahead -> land N+1 ...

        Where N+1 needs N's tokens (a fork, a preemption), it is scheduled after N lands, as above.
        """
        ahead = self.config.async_scheduling
        async with self._lock():
            flight: StepInFlight | None = None
            while flight is not None or self.scheduler.has_unfinished_requests():
                if flight is None and self._evacuating:
                    break  # evacuate(): the requests move elsewhere
                try:
                    if flight is None:
                        flight = self._launch()
                        if flight is None:
                            await asyncio.sleep(0)  # nothing can run now: let aborts and new requests in
                            continue
                    following = self._launch(ahead=True) if ahead and not self._evacuating else None
                except _SchedulerFailed:  # its streams got the error and it starts empty
                    if flight is not None:
                        await _discard(flight)  # handed out by the failed state: its result means nothing
                    flight = None
                    continue
                try:
                    outputs = await self._land(flight)
                except asyncio.CancelledError:
                    if following is not None:
                        _abandon(following)  # the loop is torn down (shutdown): nobody awaits it
                    raise
                except Exception:
                    if following is not None:
                        await _discard(following)  # the scheduler was reset: its result means nothing
                    flight = None
                    continue  # the streams got the error (or migrated); the scheduler was reset
                landed = flight
                if following is not None:
                    following.started = max(following.started, landed.landed or following.started)  # ran after N
                    flight = following
                else:
                    try:
                        flight = (self._launch() if self.scheduler.has_unfinished_requests() and not self._evacuating
                                  else None)
                    except _SchedulerFailed:
                        flight = None
                self._deliver(landed, outputs)

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> list[float]:
        """Sends the deltas to their streams; returns their inter-token latencies."""
        now = self.clock()
        inter_token_latencies = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            output.worker = self.worker_label
            gap = stream.put(output, now)
            if gap is not None:
                inter_token_latencies.append(gap)
            if stream.finished:
                del self._streams[output.request_id]
                self._report_finished(stream)
        return inter_token_latencies

    def _report_finished(self, stream: RequestStream) -> None:
        if self.stats_sink is not None:
            self.stats_sink.on_request_finished(stream.stats(self.worker_label))

    def fail_all(self, error: BaseException) -> None:
        """Ends every request with the error, the worker staying up (a runner or scheduler
        error: its state for them cannot be trusted). The KV accounting starts empty, and the
        next step tells the worker to forget every request it was sent, so a failed step
        leaves nothing behind on a live worker. That list may name a request the worker never
        registered (the failed step was its first) or one it dropped already (a step decided
        ahead ran after the failed one); workers ignore both."""
        forget = self.scheduler.ids_the_worker_may_hold()
        for stream in self.take_for_migration().streams.values():  # nowhere to go: fail them
            stream.fail(error)
        self.scheduler.finished_for_worker.update(forget)

    # --- migration (worker death) ------------------------------------------------------------
    def take_for_migration(self) -> Migration:
        """Removes every unfinished request and its stream; the KV accounting starts empty."""
        streams, self._streams = self._streams, {}
        return Migration(self.scheduler.take_requests_for_migration(), streams)

    async def evacuate(self) -> Migration:
        """Stops stepping (the step in flight lands and its tokens are delivered first), then
        takes every unfinished request as take_for_migration does: a retiring worker's requests
        move to another one, their streams going on. No step starts here afterwards."""
        self._evacuating = True
        task = self._loop_task
        if task is not None and not task.done():
            await asyncio.shield(task)
        return self.take_for_migration()

    def adopt(self, migration: Migration) -> None:
        """Continues migrated requests here; their streams go on without a duplicate or a gap.

        Call from inside the event loop. Raises ValueError if a request id is in use here.
        """
        loop = asyncio.get_running_loop()
        for request in migration.requests:
            self.scheduler.add_migrated_request(request)
        for request_id, stream in migration.streams.items():
            assert request_id not in self._streams, request_id
            stream.engine = self
            self._streams[request_id] = stream
        if migration.requests and (self._loop_task is None or self._loop_task.done()):
            self._loop_task = loop.create_task(self._run_loop(), context=contextvars.Context())

    # --- offline helper -------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        """Runs the prompts to completion (blocking; not from inside a running event loop)."""
        return asyncio.run(self.generate_async(prompts, params))

    async def generate_async(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[GenerateResult]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        assert len(params) == len(prompts), (len(params), len(prompts))
        streams = []
        for prompt, sp in zip(prompts, params):
            self._next_id += 1
            request = EngineRequest(f"generate-{self._next_id}", list(prompt), sp)
            streams.append((list(prompt), sp.n, self.add_request(request)))
        return list(await asyncio.gather(*(_collect(*s) for s in streams)))

    def close(self) -> None:
        self._executor.shutdown(wait=True)


class _SchedulerFailed(Exception):
    """Engine._launch: the scheduler raised; Engine._scheduler_failed has ended its requests."""


def _abandon(flight: StepInFlight) -> None:
    result = flight.result
    if inspect.iscoroutine(result):
        result.close()
    elif isinstance(result, asyncio.Future):
        result.cancel()


async def _discard(flight: StepInFlight) -> None:
    """Waits for a step whose result is no longer wanted (its runner's bookkeeping ends)."""
    try:
        await flight.result
    except Exception:
        pass


async def _collect(prompt: list[int], n: int, stream: RequestStream) -> GenerateResult:
    sequences = [SequenceResult(i, [], None, None) for i in range(n)]
    num_cached = 0
    async for delta in stream:
        seq = sequences[delta.index]
        seq.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            seq.logprobs = (seq.logprobs or []) + delta.new_logprobs
        seq.finish_reason = delta.finish_reason
        num_cached = delta.num_cached_tokens
    return GenerateResult(stream.request_id, prompt, num_cached, sequences)
