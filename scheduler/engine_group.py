"""EngineGroup: one in-process Engine per worker, routing, aborts and status. Pure: no Ray.

    SchedulerActor (scheduler/actor.py, the Ray shell)
        EngineGroup
            Router (scheduler/router.py) ── picks a worker per new request
            Engine 0 ── its own loop task ── TimedRunner 0 ── worker 0
            Engine 1 ── its own loop task ── TimedRunner 1 ── worker 1   ...

- Each Engine runs its own step loop (a task on the actor's event loop) and awaits ONE
  call per step on its worker through a TimedRunner, so the engines step concurrently: a
  slow worker delays only its own requests, never another worker's steps. A worker that is
  an awaitable handle (a Ray actor) is awaited; a plain object with a blocking execute()
  (tests, in-process benchmarks) runs on the runner's own thread.
- A new request is routed once by the Router over the live workers' schedulers (exact
  prefix matches and loads; the policy and its knobs are RouterConfig). Each decision's
  outcome is counted in `route_counts` (RouteOutcome value -> requests) for metrics.
  n>1 requests are routed once: their worker's Scheduler forks the children there.
- LoRA adapters: the group keeps the registry of adapters served (`lora_paths`, name ->
  directory: the start-time ones, then add_lora / remove_lora at run time). A request of an
  adapter gets its directory here, once, and keeps it: removing the adapter refuses new
  requests of it (UnknownLoraError, HTTP 404) while the ones queued or running finish on the
  copy their worker holds; each worker unloads it once no request of its uses it.
  `lora_route_counts` counts adapter hits (routed to a worker holding it) and loads.
- Dead workers (TimedRunner.alive False) are never chosen; with none alive, add_request
  raises NoLiveWorkerError (the ingress answers 503).
- Elastic workers (the Ray shell applies scheduler/autoscale.py's decisions): each worker has a
  state, `starting` (add_worker: loading, takes no requests), `serving` (mark_serving: the
  router may place requests on it), `draining` (retire: no new requests; its own finish for up
  to the drain timeout, then the rest move to serving workers by the migration path below, so
  no stream fails or changes its text) and `retired` (gone; its index is never reused).
  wait_for_serving() lets a request that finds no serving worker wait for one to start.
- abort() frees the request's blocks at once. An abort that arrives before its request
  (calls from one caller may interleave on an async actor) is remembered and the request is
  refused when it shows up.
- status() is answered from the group's own state (no worker call): SchedulerStatus.
- Admission (scheduler/admission.py) runs before routing: a bounded queue (QueueFullError,
  HTTP 429) and drain() (DrainingError, HTTP 503; open requests finish, the rest is aborted
  at the deadline).
- A worker that dies (its TimedRunner's is_death says so) loses nothing: the failed step's
  engine hands over every request (Engine.take_for_migration; its block accounting is
  dropped) and each is routed to a live worker, recomputed from prompt + tokens so far, its
  stream going on without a gap or a duplicate. With no live worker the requests wait
  (worker_restart_timeout_s) for one to come back. Any other runner error fails the streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from scheduler.admission import Admission, AdmissionConfig
from scheduler.autoscale import unique_cached_blocks
from scheduler.engine import Engine, Migration, RequestStream, StreamListener
from scheduler.outputs import EngineRequest, FinishReason, ModelRunnerOutput, RequestOutput, SchedulerOutput
from scheduler.router import Route, Router, route_request

logger = logging.getLogger(__name__)

NUM_REMEMBERED_ABORTS = 4096  # aborts of not-yet-seen request ids kept for the race above
GAP_WINDOW_S = 1.0  # a pause between steps longer than this is idleness (no work), not a gap
STARTING, SERVING, DRAINING, RETIRED = "starting", "serving", "draining", "retired"  # a worker's states


class UnknownLoraError(ValueError):
    """The request names a LoRA adapter this server does not serve (HTTP 404)."""


class NoLiveWorkerError(RuntimeError):
    """Every worker of the group is dead: nothing can take a request now (HTTP 503)."""


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
    draining: bool = False  # shutting down: new requests are refused, open ones finish
    num_rejected_requests: int = 0  # refused by admission since start (queue full, draining)
    num_migrated_requests: int = 0  # client requests moved off a dead (or retired) worker since start
    num_starting_workers: int = 0  # workers loading (elastic workers), not counted in num_workers
    can_wake: bool = False  # with no live worker, a request waits for one to start (scale from zero)


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
        self.busy_s = 0.0  # clock seconds spent inside execute() calls that returned
        self.gap_s = 0.0  # clock seconds from a step's return to the next step's submission, back to back
        self.last_step_end: float | None = None  # clock() when the last step returned
        self.busy_since: float | None = None  # clock() when work became pending (set by the group)
        # The worker incarnation this engine's block accounting belongs to (set by the actor's
        # ping); sent with each step, so a restarted worker refuses it (WorkerStateLostError).
        self.incarnation: str | None = None
        self._executor: ThreadPoolExecutor | None = None  # a blocking worker's own thread, made on first use
        self._remote: Callable[..., Awaitable[ModelRunnerOutput]] | None = None  # set by _remote_execute
        self._in_flight = 0  # steps submitted and not returned
        # A same-node worker's step socket (scheduler/step_channel.py; set by the Ray shell):
        # steps go there instead of a Ray call once no Ray step is in flight (order is kept).
        self.channel: Any = None  # a StepChannel, or None
        self._ray_in_flight = 0  # Ray calls submitted and not returned
        self.num_channel_steps = 0  # steps sent on the channel

    async def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return await self.start(scheduler_output)

    def start(self, scheduler_output: SchedulerOutput) -> Awaitable[ModelRunnerOutput]:
        """Hands the step to the worker NOW (a Ray call is submitted, a blocking worker's
        thread starts) and returns what to await for its result."""
        now = self._clock()
        if self.last_step_end is not None and self._in_flight == 0 and now - self.last_step_end < GAP_WINDOW_S:
            self.gap_s += now - self.last_step_end  # the worker waited for us (no step queued)
        self._in_flight += 1
        return self._timed(self._submit(scheduler_output), now)

    async def _timed(self, pending: Awaitable[ModelRunnerOutput], started: float) -> ModelRunnerOutput:
        try:
            result = await pending
        except BaseException as error:
            if self._is_death(error):
                self.alive = False
            raise
        finally:
            self._in_flight -= 1
        self.alive = True
        self.num_steps += 1
        previous_end, self.last_step_end = self.last_step_end, self._clock()
        # A step submitted ahead (async scheduling) waits for the one before it: count from its end.
        self.busy_s += self.last_step_end - max(started, previous_end or started)
        return result

    def _submit(self, scheduler_output: SchedulerOutput) -> Awaitable[ModelRunnerOutput]:
        channel = self.channel
        if channel is not None and not channel.closed and self._ray_in_flight == 0:
            self.num_channel_steps += 1
            return channel.call(scheduler_output)
        remote = self._remote_execute()
        if remote is not None:  # a Ray actor handle: an ObjectRef, awaited
            self._ray_in_flight += 1
            if self.incarnation is not None:
                return self._ray_step(remote(scheduler_output, self.incarnation))
            return self._ray_step(remote(scheduler_output))
        if inspect.iscoroutinefunction(self.worker.execute):
            return self.worker.execute(scheduler_output)
        # A blocking worker (tests, in-process benchmarks): on this runner's own thread, so the
        # event loop and every other runner go on while it computes.
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="timed-runner")
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._executor, self.worker.execute, scheduler_output)

    def _ray_step(self, pending: Awaitable[ModelRunnerOutput]) -> Awaitable[ModelRunnerOutput]:
        """The Ray call as a future that counts itself out when the call completes, whether or
        not anyone awaits it (a step abandoned at shutdown must not pin later steps to Ray, and
        a socket step must not overtake a Ray step still running)."""
        future = asyncio.ensure_future(pending)
        future.add_done_callback(self._ray_step_done)
        return asyncio.shield(future)  # a cancelled awaiter leaves the call running, and counted

    def _ray_step_done(self, future: asyncio.Future[ModelRunnerOutput]) -> None:
        self._ray_in_flight -= 1
        if not future.cancelled():
            future.exception()  # retrieved here: an abandoned step's error is not logged as lost

    def _remote_execute(self) -> Callable[..., Awaitable[ModelRunnerOutput]] | None:
        """The worker's execute as a Ray call (None: not a Ray handle). Per-step calls leave
        Ray's task events out: ten or more a second per worker would flood the dashboard's
        task table and the GCS with records nobody reads (the actors and their logs stay)."""
        if self._remote is None:
            method = self.worker.execute
            if getattr(method, "remote", None) is None:
                return None
            options = getattr(method, "options", None)
            self._remote = (options(enable_task_events=False) if options is not None else method).remote
        return self._remote

    def seconds_without_progress(self, now: float) -> float:
        marks = [mark for mark in (self.last_step_end, self.busy_since) if mark is not None]
        return now - max(marks) if marks else 0.0

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        if self.channel is not None:
            self.channel.close()


class EngineGroup:
    """Pure: one Engine per runner, routing, aborts and status. No Ray."""

    def __init__(self, engines: list[Engine], runners: list[TimedRunner],
                 clock: Callable[[], float] = time.monotonic, router: Router | None = None,
                 admission: Admission | None = None, worker_restart_timeout_s: float = 120.0,
                 lora_adapters: dict[str, str] | None = None) -> None:
        assert engines and len(engines) == len(runners)
        self.engines = engines
        self.runners = runners
        self.admission = admission or Admission(AdmissionConfig(max_num_seqs=engines[0].config.max_num_seqs))
        self.worker_restart_timeout_s = worker_restart_timeout_s  # parked requests wait this long for a live worker
        self.num_migrated_requests = 0  # client requests moved off a dead (or retired) worker
        self.states: list[str] = [SERVING] * len(engines)  # per worker (module docstring)
        self.can_wake = False  # set by an elastic shell: requests wait for a worker instead of a 503
        self._parked: list[Migration] = []  # requests of dead workers while no worker is alive
        self._unpark_task: asyncio.Task[None] | None = None
        for index, engine in enumerate(engines):
            if engine.on_runner_error is None:
                engine.on_runner_error = functools.partial(self._on_runner_error, index)
        self.router = router or Router()
        self.route_counts: Counter[str] = Counter()  # RouteOutcome value -> requests routed so
        self.routed_per_worker: Counter[int] = Counter()  # worker index -> requests routed there
        self.last_route: Route | None = None  # the latest decision (debugging, tests)
        self.lora_paths: dict[str, str] = dict(lora_adapters or {})  # adapter name -> directory, served now
        self.lora_version = 0  # add_lora and remove_lora calls so far (ingress replicas keep the newest list)
        self.lora_route_counts: Counter[str] = Counter()  # "hit" | "load" -> requests of an adapter routed
        self._clock = clock
        self._owner: dict[str, int] = {}  # request_id -> engine index, while streaming
        self._early_aborts: deque[str] = deque(maxlen=NUM_REMEMBERED_ABORTS)

    def add_request(self, request: EngineRequest, listener: StreamListener | None = None) -> RequestStream | None:
        """The request's stream, or None if it was aborted before it arrived.

        listener: see RequestStream. Raises ValueError if it can never run,
        NoLiveWorkerError if no worker is alive.
        """
        if request.request_id in self._early_aborts:
            self._early_aborts.remove(request.request_id)
            return None
        if request.lora_name is not None and request.lora_path is None:
            path = self.lora_paths.get(request.lora_name)
            if path is None:
                raise UnknownLoraError(f"the model {request.lora_name!r} does not exist; this server serves the "
                                       f"LoRA adapters {sorted(self.lora_paths)}")
            request = dataclasses.replace(request, lora_path=path)
        live = [self.engines[index].scheduler.load() for index in sorted(self.serving())]
        self.admission.check(live, len(request.prompt_token_ids))  # DrainingError, QueueFullError
        index = self._pick_engine(request)
        engine = self.engines[index]
        if not engine.has_unfinished_requests():
            self.runners[index].busy_since = self._clock()
        stream = engine.add_request(request, listener)  # raises ValueError if it can never run
        self._owner[request.request_id] = index
        return stream

    def serving(self) -> set[int]:
        """Indices of the workers that take new requests: serving and not known dead."""
        return {i for i, (runner, state) in enumerate(zip(self.runners, self.states)) if runner.alive and state == SERVING}

    def _pick_engine(self, request: EngineRequest) -> int:
        alive = self.serving()
        if not alive:
            raise NoLiveWorkerError(f"none of the {self.num_workers()} workers is serving")
        if not request.prompt_token_ids:  # the scheduler refuses it with a ValueError
            return min(alive)
        schedulers = {i: engine.scheduler for i, engine in enumerate(self.engines)}
        route = route_request(self.router, schedulers, request.prompt_token_ids, alive, request.lora_name,
                              request.lora_path)
        assert route is not None and route.worker_id in alive, route
        self.route_counts[route.outcome.value] += 1
        self.routed_per_worker[route.worker_id] += 1
        if route.adapter_hit is not None:
            self.lora_route_counts["hit" if route.adapter_hit else "load"] += 1
        self.last_route = route
        return route.worker_id

    def routing_stats(self) -> dict[str, Any]:
        """Plain counters for metrics and admin views (cheap to serialize)."""
        return {
            "policy": self.router.config.policy.value,
            "route_counts": dict(self.route_counts),  # outcome -> requests
            "routed_per_worker": [self.routed_per_worker[i] for i in range(len(self.engines))],  # requests
            "running_per_worker": [engine.scheduler.num_running_seqs for engine in self.engines],  # sequences now
            "steps_per_worker": [runner.num_steps for runner in self.runners],  # engine steps
            "busy_s_per_worker": [runner.busy_s for runner in self.runners],  # seconds in execute()
            "gap_s_per_worker": [runner.gap_s for runner in self.runners],  # seconds between back-to-back steps
            "channel_steps_per_worker": [runner.num_channel_steps for runner in self.runners],  # on the step socket
            "prefix_hit_tokens_per_worker": [engine.stats.num_prefix_hit_tokens for engine in self.engines],
            "prefix_query_tokens_per_worker": [engine.stats.num_prefix_query_tokens for engine in self.engines],
            "lora_route_counts": dict(self.lora_route_counts),  # "hit" | "load" -> adapter requests
            "lora_adapters_per_worker": [engine.scheduler.loras.loaded() for engine in self.engines],
            "lora_loads_per_worker": [engine.scheduler.loras.counts.num_loads for engine in self.engines],
        }

    # --- LoRA adapters -----------------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Serves the adapter at path as name from now on (checked by the caller). Raises
        ValueError if the name is served already (unload it first)."""
        if name in self.lora_paths:
            raise ValueError(f"the LoRA adapter {name!r} is loaded already (from {self.lora_paths[name]}); "
                             "unload it first")
        self.lora_paths[name] = path
        self.lora_version += 1

    def remove_lora(self, name: str) -> None:
        """Stops serving the adapter: new requests of it are refused; queued and running ones
        finish. Raises UnknownLoraError if it is not served."""
        if self.lora_paths.pop(name, None) is None:
            raise UnknownLoraError(f"the LoRA adapter {name!r} cannot be found; this server serves "
                                   f"{sorted(self.lora_paths)}")
        self.lora_version += 1
        for engine in self.engines:
            engine.scheduler.discard_adapter(name)

    def lora_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """(requests, generated tokens) per adapter, summed over the workers, since start."""
        requests: Counter[str] = Counter()
        tokens: Counter[str] = Counter()
        for engine in self.engines:
            requests.update(engine.scheduler.lora_requests)
            tokens.update(engine.scheduler.lora_generation_tokens)
        return dict(requests), dict(tokens)

    def owner_of(self, request_id: str) -> int | None:
        """The index of the worker streaming this request, or None."""
        return self._owner.get(request_id)

    def abort(self, request_id: str) -> None:
        index = self._owner.get(request_id)
        if index is None:
            self._early_aborts.append(request_id)
            return
        if self._parked and self._abort_parked(request_id):
            return
        self.engines[index].abort(request_id)

    # --- worker death: migrate -------------------------------------------------------------
    def _on_runner_error(self, index: int, engine: Engine, error: Exception) -> None:
        """A step failed. If the worker died, its requests go on on live workers: each is
        recomputed from prompt + tokens generated so far, so its stream has no gap and no
        duplicate. Any other error fails them (the worker's state is unknown)."""
        if self.runners[index].alive:
            engine.fail_all(error)  # and the worker forgets their state with the next step
            return
        migration = engine.take_for_migration()  # drops this worker's block accounting
        logger.warning("worker %d died (%s): moving %d requests to live workers",
                       index, type(error).__name__, len(migration.streams))
        self.num_migrated_requests += len(migration.streams)
        self._place(migration)

    def _place(self, migration: Migration) -> None:
        alive = self.serving()
        if not alive:
            self._parked.append(migration)
            if self._unpark_task is None or self._unpark_task.done():
                self._unpark_task = asyncio.get_running_loop().create_task(self._unpark())
            return
        schedulers = {i: engine.scheduler for i, engine in enumerate(self.engines)}
        for client_id, part in split_by_client(migration):
            if not part.requests:  # an open stream with nothing left to run: never expected
                part.streams[client_id].fail(RuntimeError(f"{client_id}: lost in migration"))
                continue
            route = route_request(self.router, schedulers, part.requests[0].prompt_token_ids, alive,
                                  part.requests[0].lora_name, part.requests[0].lora_path)
            target = route.worker_id if route is not None else min(alive)
            if not self.engines[target].has_unfinished_requests():
                self.runners[target].busy_since = self._clock()
            self.engines[target].adopt(part)
            self._owner[client_id] = target

    async def _unpark(self) -> None:
        """Waits for a worker to come back (Ray restarts it; the ping marks it alive)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.worker_restart_timeout_s
        while self._parked and not self.serving() and loop.time() < deadline:
            await asyncio.sleep(0.1)
        parked, self._parked = self._parked, []
        for migration in parked:
            if self.serving():
                self._place(migration)
                continue
            error = NoLiveWorkerError(f"no worker came back within {self.worker_restart_timeout_s:g}s")
            for client_id, stream in migration.streams.items():
                stream.fail(error)
                self._owner.pop(client_id, None)

    def _abort_parked(self, client_id: str) -> bool:
        """Finishes a parked request (final abort deltas); False if it is not parked."""
        for migration in self._parked:
            stream = migration.streams.pop(client_id, None)
            if stream is None:
                continue
            mine = [r for r in migration.requests if r.client_request_id == client_id]
            migration.requests[:] = [r for r in migration.requests if r.client_request_id != client_id]
            now = self._clock()
            for request in mine:
                indices = range(request.num_seqs) if request.is_fork_parent else (request.index,)
                for i in indices:
                    stream.put(RequestOutput(client_id, i, [], None, FinishReason.ABORT,
                                             request.num_prompt_tokens, request.num_cached_tokens), now)
            return True
        return False

    # --- elastic workers ---------------------------------------------------------------------
    def num_workers(self) -> int:
        """Workers starting, serving or draining (retired ones are gone)."""
        return sum(state != RETIRED for state in self.states)

    def add_worker(self, engine: Engine, runner: TimedRunner) -> int:
        """A new worker, `starting` until mark_serving; returns its index (never reused)."""
        index = len(self.engines)
        if engine.on_runner_error is None:
            engine.on_runner_error = functools.partial(self._on_runner_error, index)
        self.engines.append(engine)
        self.runners.append(runner)
        self.states.append(STARTING)
        return index

    def mark_serving(self, index: int) -> None:
        """The worker has loaded and warmed up: the router may place requests on it."""
        assert self.states[index] == STARTING, (index, self.states[index])
        self.states[index] = SERVING

    async def wait_for_serving(self, timeout_s: float, poll_s: float = 0.05) -> bool:
        """Waits up to timeout_s for a serving worker; whether there is one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.serving() and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        return bool(self.serving())

    async def retire(self, index: int, drain_timeout_s: float, poll_s: float = 0.05) -> int:
        """Drains the worker: no new requests from now on; its own ones finish for up to
        drain_timeout_s, then the rest move to serving workers (recomputed from prompt + tokens
        so far, their streams going on) or wait for one (worker_restart_timeout_s). Returns how
        many client requests moved. The worker's actor is the caller's to end afterwards."""
        assert self.states[index] in (STARTING, SERVING), (index, self.states[index])
        self.states[index] = DRAINING
        engine, runner = self.engines[index], self.runners[index]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while engine.has_unfinished_requests() and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        migration = await engine.evacuate()
        if migration.streams:
            logger.info("worker %d retires: moving %d requests that outlived the drain timeout",
                        index, len(migration.streams))
            self.num_migrated_requests += len(migration.streams)
            self._place(migration)
        self.states[index] = RETIRED
        runner.alive = False
        engine.close()
        runner.close()
        return len(migration.streams)

    def unique_cached_blocks(self) -> dict[int, int]:
        """Per serving or draining worker: cached prefix blocks no other serving worker holds
        (what retiring it would lose)."""
        cached = {i: self.engines[i].scheduler.kv.pool.cached.keys() for i, state in enumerate(self.states)
                  if state in (SERVING, DRAINING)}
        return unique_cached_blocks(cached, [i for i in cached if self.states[i] == SERVING])

    def num_parked(self) -> int:
        """Client requests of dead or retired workers waiting for a serving worker."""
        return sum(len(migration.streams) for migration in self._parked)

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Refuses new requests from now on (DrainingError), lets the open ones finish for up
        to timeout_s, then aborts the rest; returns how many were aborted."""
        self.admission.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._owner and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        left = list(self._owner)
        for request_id in left:
            self.abort(request_id)
        return len(left)

    def forget(self, request_id: str) -> None:
        self._owner.pop(request_id, None)

    def status(self) -> SchedulerStatus:
        now = self._clock()
        loads = [engine.scheduler.load() for engine in self.engines]
        pending = [r for r, e in zip(self.runners, self.engines) if e.has_unfinished_requests()]
        stalls = [runner.seconds_without_progress(now) for runner in pending]
        return SchedulerStatus(
            num_workers=sum(state in (SERVING, DRAINING) for state in self.states),
            num_live_workers=len(self.serving()),
            num_running=sum(load.num_running_seqs for load in loads),
            num_waiting=sum(load.num_waiting_reqs for load in loads),
            num_unfinished_requests=len(self._owner),
            seconds_since_last_step=max(stalls) if stalls else None,
            num_kv_blocks_free=sum(load.num_free_blocks for load in loads),
            num_kv_blocks_total=sum(load.num_usable_blocks for load in loads),
            num_steps=sum(runner.num_steps for runner in self.runners),
            draining=self.admission.draining,
            num_rejected_requests=self.admission.num_rejected_total,
            num_migrated_requests=self.num_migrated_requests,
            num_starting_workers=self.states.count(STARTING),
            can_wake=self.can_wake,
        )

    def close(self) -> None:
        for engine, runner, state in zip(self.engines, self.runners, self.states):
            if state == RETIRED:
                continue  # closed when it retired
            engine.close()
            runner.close()


def split_by_client(migration: Migration) -> list[tuple[str, Migration]]:
    """One Migration per client request (its sequences and its stream), oldest first."""
    parts: dict[str, Migration] = {}
    for request in migration.requests:
        client_id = request.client_request_id
        if client_id not in parts:
            parts[client_id] = Migration([], {client_id: migration.streams[client_id]})
        parts[client_id].requests.append(request)
    for client_id, stream in migration.streams.items():  # a stream with no request left: nothing to run
        parts.setdefault(client_id, Migration([], {client_id: stream}))
    return list(parts.items())
