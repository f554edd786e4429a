"""SchedulerActor: the Ray shell over one in-process Engine per worker.

    ingress --generate(EngineRequest)--> SchedulerActor --execute(SchedulerOutput)--> WorkerActor
            <--- lists of RequestOutput --              <--- ModelRunnerOutput ---

- EngineGroup (pure, no Ray) holds one scheduler.engine.Engine per worker. Each Engine's
  loop awaits ONE Ray call per step on its worker (TimedRunner wraps the handle), so the
  actor's event loop is free between steps: generate, abort and status never wait on a step.
- A new request goes to the live worker with the least load (running + waiting). A
  prefix-cache-aware router can replace `_pick_engine` without touching the actor.
- generate() is a Ray streaming generator: it yields list[RequestOutput], every delta that
  accumulated since the previous yield (one per step when the reader keeps up, fewer,
  larger items when it does not). The ingress reads it with
  `async for ref in gen: batch = await ref`.
- abort() frees the request's blocks at once. An abort that arrives before its generate
  (possible: calls from one caller may interleave on an async actor) is remembered and
  the request is refused when it shows up.
- status() is answered from the actor's own state (no worker call): SchedulerStatus.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine, RequestStream
from scheduler.outputs import EngineRequest, ModelRunnerOutput, RequestOutput, SchedulerOutput

logger = logging.getLogger(__name__)

NUM_REMEMBERED_ABORTS = 4096  # aborts of not-yet-seen request ids kept for the race above
WORKER_PING_INTERVAL_S = 2.0
WORKER_PING_TIMEOUT_S = 10.0
ACTOR_NAMESPACE = "rayllm"  # named scheduler and worker actors live here (ray.get_actor(name, namespace))


@dataclass(frozen=True, slots=True)
class SchedulerStatus:
    """A snapshot for /health and admin views (plain values, cheap to serialize)."""

    num_workers: int  # worker actors configured
    num_live_workers: int  # of those, not known to be dead
    num_running: int  # sequences in running batches, all workers
    num_waiting: int  # requests queued, all workers
    num_unfinished_requests: int  # client requests with an open stream
    seconds_since_last_step: float | None  # worst over workers with pending work; None when idle
    num_kv_blocks_free: int  # allocatable blocks (cached-but-free included), all workers
    num_kv_blocks_total: int  # usable blocks (null blocks excluded), all workers
    num_steps: int  # engine steps completed, all workers


class TimedRunner:
    """An async runner over a worker (a Ray handle or any object with execute()), which
    records step times and whether the worker is alive."""

    def __init__(self, worker: Any, clock: Callable[[], float] = time.monotonic,
                 is_death: Callable[[BaseException], bool] = lambda error: False) -> None:
        self.worker = worker
        self._clock = clock
        self._is_death = is_death
        self.alive = True
        self.num_steps = 0
        self.last_step_end: float | None = None  # clock() when the last step returned
        self.busy_since: float | None = None  # clock() when work became pending (set by the group)

    async def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        try:
            result = self._call(scheduler_output)
            if inspect.isawaitable(result):
                result = await result
            else:
                await asyncio.sleep(0)  # a sync worker (tests): let other tasks run between steps
        except BaseException as error:
            if self._is_death(error):
                self.alive = False
            raise
        self.alive = True
        self.num_steps += 1
        self.last_step_end = self._clock()
        return result

    def _call(self, scheduler_output: SchedulerOutput) -> Any:
        remote = getattr(self.worker.execute, "remote", None)
        return remote(scheduler_output) if remote is not None else self.worker.execute(scheduler_output)

    def seconds_without_progress(self, now: float) -> float:
        marks = [mark for mark in (self.last_step_end, self.busy_since) if mark is not None]
        return now - max(marks) if marks else 0.0


class EngineGroup:
    """Pure: one Engine per runner, routing, aborts and status. No Ray."""

    def __init__(self, engines: list[Engine], runners: list[TimedRunner],
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert engines and len(engines) == len(runners)
        self.engines = engines
        self.runners = runners
        self._clock = clock
        self._owner: dict[str, int] = {}  # request_id -> engine index, while streaming
        self._early_aborts: deque[str] = deque(maxlen=NUM_REMEMBERED_ABORTS)

    def add_request(self, request: EngineRequest) -> RequestStream | None:
        """The request's stream, or None if it was aborted before it arrived."""
        if request.request_id in self._early_aborts:
            self._early_aborts.remove(request.request_id)
            return None
        index = self._pick_engine()
        engine = self.engines[index]
        if not engine.has_unfinished_requests():
            self.runners[index].busy_since = self._clock()
        stream = engine.add_request(request)  # raises ValueError if it can never run
        self._owner[request.request_id] = index
        return stream

    def _pick_engine(self) -> int:
        live = [i for i, runner in enumerate(self.runners) if runner.alive] or list(range(len(self.runners)))
        def load(i: int) -> tuple[int, int]:
            scheduler_load = self.engines[i].scheduler.load()
            return scheduler_load.num_running_seqs + scheduler_load.num_waiting_reqs, i
        return min(live, key=load)

    def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        if index is None:
            self._early_aborts.append(request_id)
            return
        self.engines[index].abort(request_id)

    def forget(self, request_id: str) -> None:
        self._owner.pop(request_id, None)

    def status(self) -> SchedulerStatus:
        now = self._clock()
        loads = [engine.scheduler.load() for engine in self.engines]
        pending = [r for r, e in zip(self.runners, self.engines) if e.has_unfinished_requests()]
        stalls = [runner.seconds_without_progress(now) for runner in pending]
        return SchedulerStatus(
            num_workers=len(self.runners),
            num_live_workers=sum(runner.alive for runner in self.runners),
            num_running=sum(load.num_running_seqs for load in loads),
            num_waiting=sum(load.num_waiting_reqs for load in loads),
            num_unfinished_requests=len(self._owner),
            seconds_since_last_step=max(stalls) if stalls else None,
            num_kv_blocks_free=sum(load.num_free_blocks for load in loads),
            num_kv_blocks_total=sum(load.num_usable_blocks for load in loads),
            num_steps=sum(runner.num_steps for runner in self.runners),
        )


async def batched(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[list[RequestOutput]]:
    """Every delta that arrived since the last yield, as one list."""
    buffer: list[RequestOutput] = []
    wake = asyncio.Event()
    state: dict[str, Any] = {"done": False, "error": None}

    async def pump() -> None:
        try:
            async for output in stream:
                buffer.append(output)
                wake.set()
        except Exception as error:
            state["error"] = error
        finally:
            state["done"] = True
            wake.set()

    task = asyncio.create_task(pump())
    try:
        while True:
            await wake.wait()
            wake.clear()
            finished = state["done"]  # read before taking: everything pumped is in buffer
            if buffer:
                batch = buffer[:]
                buffer.clear()
                yield batch
            if finished:
                if state["error"] is not None:
                    raise state["error"]
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def is_actor_death(error: BaseException) -> bool:
    return isinstance(error, (RayActorError, ActorDiedError, ActorUnavailableError))


@ray.remote
class SchedulerActor:
    """Options (num_cpus, max_restarts, name) are given at creation: see create_scheduler."""

    def __init__(self, config: SchedulerConfig, workers: list[Any], eos_token_ids: tuple[int, ...]) -> None:
        self._workers = workers
        runners = [TimedRunner(worker, is_death=is_actor_death) for worker in workers]
        engines = [Engine(config, runner, eos_token_ids) for runner in runners]
        self._group = EngineGroup(engines, runners)
        self._incarnations: list[str | None] = [None] * len(workers)
        self._watch_task: asyncio.Task[None] | None = None

    async def ready(self) -> bool:
        self._ensure_watching()
        return True

    def _ensure_watching(self) -> None:
        """Starts the worker watch on the first call (also after Ray restarted this actor)."""
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_workers())

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[RequestOutput]]:
        self._ensure_watching()
        stream = self._group.add_request(request)
        if stream is None:
            return
        try:
            async for batch in batched(stream):
                yield batch
        finally:
            await stream.aclose()  # aborts the request if it is still running
            self._group.forget(request.request_id)

    async def abort(self, request_id: str) -> None:
        self._group.abort(request_id)

    async def status(self) -> SchedulerStatus:
        self._ensure_watching()
        return self._group.status()

    async def _watch_workers(self) -> None:
        """Pings idle workers; a restarted worker (new incarnation) gets an empty cache."""
        while True:
            for index, worker in enumerate(self._workers):
                await self._ping(index, worker)
            await asyncio.sleep(WORKER_PING_INTERVAL_S)

    async def _ping(self, index: int, worker: Any) -> None:
        runner, engine = self._group.runners[index], self._group.engines[index]
        try:
            incarnation = await asyncio.wait_for(worker.ping.remote(), WORKER_PING_TIMEOUT_S)
        except asyncio.TimeoutError:
            return  # busy (a long step): the step deadline in status() covers a stuck worker
        except Exception as error:
            if is_actor_death(error):
                runner.alive = False
            return
        runner.alive = True
        previous, self._incarnations[index] = self._incarnations[index], incarnation
        if previous is not None and previous != incarnation and not engine.has_unfinished_requests():
            logger.warning("worker %d restarted: dropping its prefix cache", index)
            engine.scheduler.take_requests_for_migration()


def scheduler_actor_name(app_name: str) -> str:
    return f"{app_name}-scheduler"


def create_scheduler(
    config: SchedulerConfig,
    workers: list[Any],
    eos_token_ids: tuple[int, ...],
    *,
    name: str,
    num_cpus: float = 0.25,
    max_restarts: int = 3,
    namespace: str = ACTOR_NAMESPACE,
) -> Any:
    """A named SchedulerActor (or the live one of that name)."""
    return SchedulerActor.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        num_cpus=num_cpus,
        max_restarts=max_restarts,
        max_concurrency=10_000,  # async actor: concurrent streams, not threads
    ).remote(config, workers, eos_token_ids)
