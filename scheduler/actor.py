"""SchedulerActor: the Ray shell over one in-process Engine per worker.

    ingress replica --submit(EngineRequest, channel)--> SchedulerActor --execute(SchedulerOutput)--> WorkerActor
                    <== outputs(channel): ONE stream ==              <--- ModelRunnerOutput ---
                        one list of deltas per step, every request of that replica

- EngineGroup (scheduler/engine_group.py, pure, no Ray) holds one scheduler.engine.Engine
  per worker. Each Engine's loop awaits ONE call per step on its worker (TimedRunner
  wraps the handle), so the engines step concurrently and the actor's event loop is free
  between steps: submit, abort and status never wait on a step. A step's deltas are handed
  out while the worker already runs the next step (Engine._run_loop).
- That call is a frame on the worker's Unix socket when the worker runs on this node
  (scheduler/step_channel.py: a tenth of a Ray call's CPU), else a Ray actor call. The
  first ping of each worker incarnation opens the socket; a closed socket is a dead worker.
- A new request goes where the group's Router sends it (scheduler/router.py; policy and
  knobs from RouterConfig, default prefix_aware); no live worker: NoLiveWorkerError (503).
- submit() queues a request and returns once it is admitted (its errors: ValueError 400,
  QueueFullError 429, DrainingError and NoLiveWorkerError 503); False when it was aborted
  before it arrived. Its deltas go to the replica's output channel
  (scheduler/output_channel.py), which outputs(channel_id), a Ray streaming generator the
  replica keeps open, yields as one list per step: one message per step per replica. A
  replica on this node reads it over this actor's Unix socket instead (output_address()).
- abort() frees the request's blocks at once. An abort that arrives before its submit
  (possible: calls from one caller may interleave on an async actor) is remembered and
  the request is refused when it shows up.
- status() is answered from the actor's own state (no worker call): SchedulerStatus.
- Elastic workers (an `ElasticWorkers` given at creation: app arguments min_workers and
  max_workers): every AUTOSCALE_INTERVAL_S the actor hands the group's load to the pure policy
  (scheduler/autoscale.py) and applies its decision. Up: a new worker actor is created where Ray
  has room (or stays pending, which Ray's autoscaler sees as demand for a node); it loads and
  warms up, then serves. Down: the policy's victim drains (EngineGroup.retire: nothing fails or
  changes its text), then its actor is killed. With no serving worker (scale to zero) a request
  waits in submit() for one to start instead of a 503.
- Metrics: the engines report StepStats/RequestStats to one EngineMetrics (scheduler/
  metrics.py), which records them twice: into ray.util.metrics (RayMetrics below: Ray's
  Prometheus export, as ray_rayllm_*) and into a pure MetricStore that published_stats()
  returns, with per-worker state (node, KV, running), for the ingress's /metrics and
  /v1/server_info. A background task refreshes the gauges every METRICS_INTERVAL_S and
  aborts the requests of output channels nobody has read for ORPHAN_AFTER_S.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from scheduler.autoscale import AutoscaleConfig, AutoscalePolicy, ClusterLoad, ScaleDecision, worker_load
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.engine_group import (  # noqa: F401  (SchedulerStatus, NoLiveWorkerError: re-exported)
    DRAINING,
    RETIRED,
    SERVING,
    STARTING,
    EngineGroup,
    NoLiveWorkerError,
    SchedulerStatus,
    TimedRunner,
)
from scheduler.metrics import ENGINE_METRICS, EngineMetrics, MetricDef, MetricStore, PublishedStats, WorkerState
from scheduler.admission import Admission, AdmissionConfig
from scheduler.output_channel import ChannelItem, OutputChannels
from scheduler.outputs import EngineRequest, WorkerStateLostError
from scheduler.router import Router, RouterConfig
from scheduler.step_channel import StepChannel, StepChannelClosed, private_socket_path

logger = logging.getLogger(__name__)

WORKER_PING_INTERVAL_S = 2.0
WORKER_PING_TIMEOUT_S = 10.0
ACTOR_NAMESPACE = "rayllm"  # named scheduler and worker actors live here (ray.get_actor(name, namespace))
METRICS_INTERVAL_S = 1.0  # gauge refresh (Ray export) and worker node lookups
NODE_INFO_TIMEOUT_S = 5.0
AUTOSCALE_INTERVAL_S = 1.0  # how often the autoscaling policy is asked


@dataclass(frozen=True)
class ElasticWorkers:
    """What the actor needs to add and retire workers (module docstring)."""

    config: AutoscaleConfig  # this shard's bounds (AppArgs.autoscale_config)
    fleet: Any  # workers.actor.WorkerFleet: makes, places and ends workers
    name_prefix: str = ""  # of this shard's elastic workers' names ("<shard>." with several shards): unique
    drain_timeout_s: float = 30.0  # a retiring worker's requests finish for this long, then migrate
    wake_timeout_s: float = 600.0  # a request that finds no serving worker waits this long for one

    def name_of(self, index: int) -> str:
        """The name (worker_actor_name's suffix, and metrics label) of this shard's worker `index`."""
        return f"{self.name_prefix}{index}"


def is_actor_death(error: BaseException) -> bool:
    return isinstance(error, (RayActorError, ActorDiedError, ActorUnavailableError))


def is_worker_lost(error: BaseException) -> bool:
    """A step failed because the worker died (its Ray actor, or its step socket: the process
    went away), or restarted and lost its state."""
    cause = getattr(error, "cause", None) if isinstance(error, RayTaskError) else error
    return is_actor_death(error) or isinstance(cause, (WorkerStateLostError, StepChannelClosed))


@ray.remote
class SchedulerActor:
    """Options (num_cpus, max_restarts, name) are given at creation: see create_scheduler."""

    def __init__(self, config: SchedulerConfig, workers: list[Any], eos_token_ids: tuple[int, ...],
                 router_config: RouterConfig | None = None, admission_config: AdmissionConfig | None = None,
                 worker_labels: list[str] | None = None, elastic: ElasticWorkers | None = None,
                 lora_adapters: dict[str, str] | None = None) -> None:
        self._workers = workers
        self._config, self._eos_token_ids = config, eos_token_ids
        for worker in workers:  # after a restart of this actor: drop request states the old one left
            worker.reset.remote()
        runners = [TimedRunner(worker, is_death=is_worker_lost) for worker in workers]
        engines = [Engine(config, runner, eos_token_ids) for runner in runners]
        admission = Admission(admission_config or AdmissionConfig(max_num_seqs=config.max_num_seqs))
        self._group = EngineGroup(engines, runners, router=Router(router_config), admission=admission,
                                  lora_adapters=lora_adapters)
        self._channels = OutputChannels(abort=self._group.abort, on_finished=self._group.forget)
        self._incarnations: list[str | None] = [None] * len(workers)
        self._channel_incarnations: list[str | None] = [None] * len(workers)  # whose step socket each runner has
        self._watch_task: asyncio.Task[None] | None = None
        self._install_metrics(worker_labels or [str(index) for index in range(len(workers))])
        self._incarnation = uuid.uuid4().hex  # a replica tells a restarted scheduler by it
        self._output_socket: asyncio.Task[str] | None = None  # path of the socket replicas on this node read
        self._elastic = elastic
        self._policy = AutoscalePolicy(elastic.config) if elastic is not None else None
        self._desired = len(workers)  # the policy's latest wish (the fixed count without autoscaling)
        self._num_waking = 0  # submits waiting for a worker to start (scale from zero)
        self._scale_tasks: set[asyncio.Task[Any]] = set()  # workers starting or retiring
        self._autoscale_task: asyncio.Task[None] | None = None
        self._group.can_wake = elastic is not None
        gc.freeze()  # startup objects leave the GC's scans: no long full-collection pauses between steps

    async def ready(self) -> bool:
        self._ensure_watching()
        return True

    def __repr__(self) -> str:
        """What the Ray dashboard's actor list shows: the workers by state (cheap, never raises)."""
        try:
            states = self._group.states
            counts = ", ".join(f"{state} {states.count(state)}" for state in (STARTING, SERVING, DRAINING))
            elastic = f", desired {self._desired}" if self._elastic is not None else ""
            return f"SchedulerActor(workers: {counts}{elastic})"
        except Exception:
            return "SchedulerActor(starting)"

    def _ensure_watching(self) -> None:
        """Starts the worker watch on the first call (also after Ray restarted this actor)."""
        # Fresh contexts: these tasks outlive the call that starts them, and Ray would parent
        # (and, on cancel, cancel) their worker calls to that call's task.
        loop = asyncio.get_running_loop()
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = loop.create_task(self._watch_workers(), context=contextvars.Context())
        if self._metrics_task is None or self._metrics_task.done():
            self._metrics_task = loop.create_task(self._refresh_metrics_forever(), context=contextvars.Context())
        if self._policy is not None and (self._autoscale_task is None or self._autoscale_task.done()):
            self._autoscale_task = loop.create_task(self._autoscale_forever(), context=contextvars.Context())

    async def submit(self, request: EngineRequest, channel_id: str) -> bool:
        """Queues the request; its deltas go to outputs(channel_id). False: it was aborted
        before it arrived. Raises what EngineGroup.add_request raises (refusals)."""
        self._ensure_watching()
        channel = self._channels.get(channel_id)
        if self._elastic is not None and not self._group.serving():
            await self._wait_for_worker()
        try:
            stream = self._group.add_request(request, self._channels.listener(channel, request.request_id))
        except BaseException:
            self._channels.refused(channel, request.request_id)
            raise
        if stream is None:
            self._channels.refused(channel, request.request_id)
            return False
        return True

    async def outputs(self, channel_id: str) -> AsyncIterator[list[ChannelItem]]:
        """The channel's deltas, one list per step (streaming generator; one reader per
        channel: a new call takes over from the previous one)."""
        self._ensure_watching()
        async for batch in self._channels.read(channel_id):
            yield batch

    async def output_address(self) -> tuple[str, str | None, str]:
        """(node id, Unix socket path or None, incarnation): a replica on this node reads its
        output channel there (OutputChannels.serve_socket_reader), not from outputs()."""
        self._ensure_watching()
        if self._output_socket is None:  # one server, however many replicas ask at once
            self._output_socket = asyncio.get_running_loop().create_task(
                self._serve_outputs(), context=contextvars.Context())
        try:
            path: str | None = await asyncio.shield(self._output_socket)
        except OSError as error:  # no usable temp dir: replicas read outputs() (Ray) instead
            logger.warning("no output socket (%r): replicas read their outputs as a Ray stream", error)
            path = None
        return ray.get_runtime_context().get_node_id(), path, self._incarnation

    async def _serve_outputs(self) -> str:
        path = private_socket_path("rayllm-outputs-", "scheduler.sock")
        self._output_server = await asyncio.start_unix_server(self._channels.serve_socket_reader, path)
        return path

    async def abort(self, request_id: str) -> None:
        self._group.abort(request_id)

    async def drain(self, timeout_s: float) -> int:
        """Shutdown: refuse new requests (503), let open ones finish for up to timeout_s,
        abort the rest; returns how many were aborted."""
        return await self._group.drain(timeout_s)

    async def status(self) -> SchedulerStatus:
        self._ensure_watching()
        return self._group.status()

    async def channel_stats(self) -> list[dict[str, Any]]:
        """Per output channel: its id, open requests, items (lists) sent and deltas in them."""
        return [
            {"channel_id": channel.channel_id, "num_open_requests": len(channel.open_request_ids),
             "num_batches": channel.num_batches, "num_deltas": channel.num_deltas,
             "reader_attached": channel.unread_since is None, "reader_transport": channel.reader_transport}
            for channel in self._channels.channels.values()
        ]

    async def routing_stats(self) -> dict[str, Any]:
        """The router's counters: outcomes, requests and steps per worker (EngineGroup.routing_stats)."""
        return self._group.routing_stats()

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Serves the PEFT adapter at path as name from now on, once a serving worker has loaded
        it to check it fits the model ({"rank", "num_bytes", "adapters": name -> path, "version"}). Raises ValueError (the adapter
        does not fit, or the name is taken) or NoLiveWorkerError."""
        self._ensure_watching()
        if name in self._group.lora_paths:
            self._group.add_lora(name, path)  # raises: the name is taken
        serving = sorted(self._group.serving())
        if not serving:
            raise NoLiveWorkerError("no worker is serving to check the adapter on")
        try:
            info = await self._workers[serving[0]].check_lora.remote(name, path)
        except RayTaskError as error:
            if isinstance(error.cause, ValueError):  # a LoraError: what does not fit, and why
                raise ValueError(str(error.cause)) from None
            raise
        self._group.add_lora(name, path)
        logger.info("LoRA adapter %r served from %s (rank %d)", name, path, info["rank"])
        return {**info, "adapters": dict(self._group.lora_paths), "version": self._group.lora_version}

    async def unload_lora(self, name: str) -> dict[str, Any]:
        """Stops serving the adapter; requests of it already queued or running finish. Returns
        {"adapters": name -> path, "version"}; raises UnknownLoraError."""
        self._group.remove_lora(name)
        logger.info("LoRA adapter %r no longer served", name)
        return {"adapters": dict(self._group.lora_paths), "version": self._group.lora_version}

    async def _watch_workers(self) -> None:
        """Pings idle workers; a restarted worker (new incarnation) gets an empty cache."""
        while True:
            for index, worker in enumerate(self._workers):
                if self._group.states[index] in (SERVING, DRAINING):  # a starting one is awaited by _start_worker
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
        self._incarnations[index] = incarnation
        if runner.incarnation is None:
            runner.incarnation = incarnation  # steps now carry it: a restarted worker refuses them
        elif runner.incarnation != incarnation:
            if engine.has_unfinished_requests():
                runner.alive = False  # its next step fails (WorkerStateLostError) and migrates them
                return
            logger.warning("worker %d restarted: it rejoins with an empty cache", index)
            engine.scheduler.take_requests_for_migration()  # resets the block accounting
            runner.incarnation = incarnation
        runner.alive = True
        broken = runner.channel is not None and runner.channel.closed
        if broken or self._channel_incarnations[index] != incarnation:
            await self._open_step_channel(index, worker)

    async def _open_step_channel(self, index: int, worker: Any) -> None:
        """Steps go over the worker's Unix socket when it runs on this node (scheduler/
        step_channel.py); elsewhere, or if the socket cannot be reached, as Ray calls."""
        runner = self._group.runners[index]
        if runner.channel is not None:
            runner.channel.close()
            runner.channel = None
        try:
            node_id, path, incarnation = await asyncio.wait_for(worker.step_address.remote(), WORKER_PING_TIMEOUT_S)
        except Exception as error:  # busy or dead: Ray calls, and the next ping asks again
            logger.info("worker %d: steps go as Ray calls for now (%r)", index, error)
            return
        if incarnation != runner.incarnation:
            return  # it restarted meanwhile: the next ping sorts that out first
        self._channel_incarnations[index] = incarnation  # asked once per incarnation (and per broken socket)
        if path is None or node_id != ray.get_runtime_context().get_node_id():
            return  # another node (or no socket there): Ray calls
        try:
            runner.channel = await StepChannel.connect(path)
        except OSError as error:  # same node id, but not the same file system (a container): Ray calls
            logger.warning("worker %d: its step socket is unreachable (%r): steps go as Ray calls", index, error)


    # --- metrics -------------------------------------------------------------------------------
    def _install_metrics(self, worker_labels: list[str]) -> None:
        """Names each engine's worker and makes one EngineMetrics every engine's stats sink."""
        self._metric_store = MetricStore(ENGINE_METRICS)
        self._metrics = EngineMetrics([self._metric_store, RayMetrics(ENGINE_METRICS)])
        self._nodes: list[tuple[str | None, dict[str, str]] | None] = [None] * len(self._workers)  # (incarnation, node)
        self._metrics_task: asyncio.Task[None] | None = None
        for engine, label in zip(self._group.engines, worker_labels, strict=True):
            engine.worker_label = label
            engine.stats_sink = self._metrics
        self._metrics.declare(worker_labels)  # every series at 0 before any traffic

    async def published_stats(self) -> PublishedStats:
        """Metrics and worker states for the ingress (no worker call: never waits on a step)."""
        self._ensure_watching()
        workers = self._refresh_gauges()
        return PublishedStats(self._metric_store.snapshot(), workers, self._group.status(),
                              dict(self._group.lora_paths), self._group.lora_version)

    def _refresh_gauges(self) -> list[WorkerState]:
        workers = self._worker_states()
        self._metrics.refresh_gauges(workers)
        self._metrics.refresh_workers(workers, self._desired)
        self._metrics.publish_route_counts(self._group.route_counts)
        self._metrics.publish_lora_counts(self._group.lora_route_counts, *self._group.lora_counts())
        return workers

    def _worker_states(self) -> list[WorkerState]:
        now = time.monotonic()  # the runners' clock
        states = []
        for index, (engine, runner) in enumerate(zip(self._group.engines, self._group.runners, strict=True)):
            if self._group.states[index] == RETIRED:
                continue
            load = engine.scheduler.load()
            node = self._nodes[index][1] if self._nodes[index] is not None else {}
            since = None if runner.last_step_end is None else max(0.0, now - runner.last_step_end)
            states.append(WorkerState(
                worker=engine.worker_label or str(index), alive=runner.alive,
                num_running_seqs=load.num_running_seqs, num_waiting_reqs=load.num_waiting_reqs,
                num_kv_blocks_used=load.num_usable_blocks - load.num_free_blocks,
                num_kv_blocks_total=load.num_usable_blocks, num_steps=runner.num_steps,
                seconds_since_last_step=since, busy_s=runner.busy_s, gap_s=runner.gap_s,
                node_id=node.get("node_id"), node_ip=node.get("node_ip"), state=self._group.states[index],
                lora_adapters=tuple(engine.scheduler.loras.loaded()),
                num_lora_loads=engine.scheduler.loras.counts.num_loads,
                num_lora_evictions=engine.scheduler.loras.counts.num_evictions,
            ))
        return states

    async def _refresh_metrics_forever(self) -> None:
        while True:
            try:
                self._refresh_gauges()
                num_orphans = self._channels.reap_orphans()
                if num_orphans:
                    logger.warning("aborted %d requests of output channels nobody reads", num_orphans)
                await self._look_up_nodes()
            except Exception:
                logger.exception("metrics refresh failed")
            await asyncio.sleep(METRICS_INTERVAL_S)

    async def _look_up_nodes(self) -> None:
        """Asks each worker its node once per incarnation (a control-group call: answers mid-step)."""
        for index, worker in enumerate(self._workers):
            if self._group.states[index] == RETIRED:
                continue
            known = self._nodes[index]
            if known is not None and known[0] == self._incarnations[index]:
                continue
            try:
                node = await asyncio.wait_for(worker.node_info.remote(), NODE_INFO_TIMEOUT_S)
            except Exception:  # dead or busy: try again on the next refresh
                continue
            self._nodes[index] = (self._incarnations[index], node)


    # --- elastic workers -------------------------------------------------------------------------
    async def _wait_for_worker(self) -> None:
        """No worker serves (scaled to zero, or all starting): the policy wakes one and this
        request waits for it (wake_timeout_s; the ingress's own request timeout may end it sooner)."""
        assert self._elastic is not None
        self._num_waking += 1
        try:
            self._autoscale_once()  # wake at once, not at the next tick
            if not await self._group.wait_for_serving(self._elastic.wake_timeout_s):
                raise NoLiveWorkerError(f"no worker started within {self._elastic.wake_timeout_s:g}s")
        finally:
            self._num_waking -= 1

    async def _autoscale_forever(self) -> None:
        while True:
            try:
                self._autoscale_once()
            except Exception:
                logger.exception("autoscaling step failed")
            await asyncio.sleep(AUTOSCALE_INTERVAL_S)

    def cluster_load(self) -> ClusterLoad:
        """The policy's view of the group now (scheduler/autoscale.py)."""
        group, now = self._group, time.monotonic()
        unique = group.unique_cached_blocks()
        workers, ages = [], []
        for index, state in enumerate(group.states):
            if state == RETIRED:
                continue
            scheduler = group.engines[index].scheduler
            ages += [now - request.arrival_time for request in scheduler.waiting]
            workers.append(worker_load(index, state, scheduler, unique.get(index, 0)))
        return ClusterLoad(tuple(workers), self._num_waking + group.num_parked(), _p90(ages))

    def _autoscale_once(self) -> ScaleDecision | None:
        if self._policy is None:
            return None
        decision = self._policy.decide(time.monotonic(), self.cluster_load())
        self._desired = decision.desired
        active = sum(state in (STARTING, SERVING) for state in self._group.states)
        for _ in range(decision.desired - active):
            self._start_worker(decision.reason)
        if decision.retire is not None and decision.desired < active:
            self._retire_worker(decision.retire, decision.reason)
        return decision

    def _track(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine, context=contextvars.Context())
        self._scale_tasks.add(task)
        task.add_done_callback(self._scale_tasks.discard)

    def _start_worker(self, reason: str) -> None:
        assert self._elastic is not None
        index = len(self._group.engines)
        name = self._elastic.name_of(index)
        live_nodes = [known[1]["node_id"] for i, known in enumerate(self._nodes)
                      if known is not None and known[1].get("node_id") and self._group.states[i] != RETIRED]
        worker = self._elastic.fleet.spawn(name, live_nodes)
        runner = TimedRunner(worker, is_death=is_worker_lost)
        engine = Engine(self._config, runner, self._eos_token_ids)
        engine.worker_label, engine.stats_sink = name, self._metrics
        assert self._group.add_worker(engine, runner) == index
        self._workers.append(worker)
        self._incarnations.append(None)
        self._channel_incarnations.append(None)
        self._nodes.append(None)
        self._metrics.on_scale_event("up", reason)
        logger.info("autoscaling: adding worker %d (%s); it serves once it has loaded", index, reason)
        self._track(self._bring_up(index, worker, time.monotonic()))

    async def _bring_up(self, index: int, worker: Any, created: float) -> None:
        """Waits for the new worker to load (Ray may first need a node for it), then lets it serve."""
        try:
            info = await worker.model_info.remote()
        except Exception as error:
            if self._group.states[index] == STARTING:  # (else: retired while it loaded, and killed)
                logger.error("worker %d failed to start (%r): retiring it", index, error)
                await self._group.retire(index, 0.0)
            return
        if self._group.states[index] != STARTING:
            return  # retired while it loaded
        if info.num_blocks < self._config.num_blocks or info.block_size != self._config.block_size:
            logger.error("worker %d has %d KV blocks of %d tokens, the group needs %d of %d: retiring it", index,
                         info.num_blocks, info.block_size, self._config.num_blocks, self._config.block_size)
            await self._group.retire(index, 0.0)
            self._elastic.fleet.retire(worker)
            return
        await self._ping(index, worker)  # its incarnation, and its step socket on this node
        self._group.mark_serving(index)
        _set_worker_state(worker, SERVING)
        seconds = time.monotonic() - created
        self._metrics.on_worker_started(seconds)
        logger.info("autoscaling: worker %d serves after %.1fs (placement, load and warm-up)", index, seconds)

    def _retire_worker(self, index: int, reason: str) -> None:
        assert self._elastic is not None
        self._metrics.on_scale_event("down", reason)
        worker = self._workers[index]
        logger.info("autoscaling: retiring worker %d (%s): draining for up to %gs", index, reason,
                    self._elastic.drain_timeout_s)
        _set_worker_state(worker, DRAINING)
        self._track(self._retire(index, worker))

    async def _retire(self, index: int, worker: Any) -> None:
        assert self._elastic is not None
        moved = await self._group.retire(index, self._elastic.drain_timeout_s)
        self._elastic.fleet.retire(worker)
        logger.info("autoscaling: worker %d retired (%d requests moved to other workers)", index, moved)


def _set_worker_state(worker: Any, state: str) -> None:
    """Tells the worker its state, for its repr in the Ray dashboard (best effort)."""
    try:
        worker.set_state.remote(state)
    except Exception:  # an older worker without it
        pass


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class RayMetrics:
    """MetricsBackend over ray.util.metrics: values recorded here reach Ray's Prometheus
    export (names prefixed `ray_`, counters suffixed `_total`) and the dashboard. Only
    usable inside a Ray process (an actor, a Serve replica, a connected driver)."""

    def __init__(self, metrics: Iterable[MetricDef]) -> None:
        from ray.util import metrics as ray_metrics

        self._metrics: dict[str, tuple[Any, tuple[str, ...]]] = {}
        for metric in metrics:
            if metric.kind == "counter":
                made = ray_metrics.Counter(metric.name, description=metric.help, tag_keys=metric.labels)
            elif metric.kind == "gauge":
                made = ray_metrics.Gauge(metric.name, description=metric.help, tag_keys=metric.labels)
            else:
                made = ray_metrics.Histogram(metric.name, description=metric.help,
                                             boundaries=list(metric.buckets), tag_keys=metric.labels)
            self._metrics[metric.name] = (made, metric.labels)
        self._tags: dict[tuple[str, tuple[str, ...]], dict[str, str]] = {}  # (name, values) -> tags

    def _get(self, name: str, labels: tuple[str, ...]) -> tuple[Any, dict[str, str] | None]:
        metric, keys = self._metrics[name]
        if not keys:
            return metric, None
        tags = self._tags.get((name, labels))
        if tags is None:
            tags = self._tags[(name, labels)] = dict(zip(keys, labels, strict=True))
        return metric, tags

    def inc(self, name: str, value: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        if value > 0:  # Ray refuses 0
            metric, tags = self._get(name, labels)
            metric.inc(value, tags=tags)

    def set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        metric, tags = self._get(name, labels)
        metric.set(value, tags=tags)

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        metric, tags = self._get(name, labels)
        metric.observe(value, tags=tags)


def scheduler_actor_name(app_name: str, shard: int = 0) -> str:
    """Shard 0 keeps the unsharded name, so single-shard tooling finds it."""
    return f"{app_name}-scheduler" if shard == 0 else f"{app_name}-scheduler-{shard}"


def create_scheduler(
    config: SchedulerConfig,
    workers: list[Any],
    eos_token_ids: tuple[int, ...],
    *,
    name: str,
    num_cpus: float = 0.25,
    max_restarts: int = 3,
    namespace: str = ACTOR_NAMESPACE,
    router_config: RouterConfig | None = None,
    admission_config: AdmissionConfig | None = None,
    worker_labels: list[str] | None = None,
    elastic: ElasticWorkers | None = None,
    lora_adapters: dict[str, str] | None = None,
) -> Any:
    """A named SchedulerActor (or the live one of that name); router_config None: defaults.
    worker_labels name the workers in metrics and server info (unique across shards; None: 0..n-1)."""
    return SchedulerActor.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        num_cpus=num_cpus,
        max_restarts=max_restarts,
        max_concurrency=10_000,  # async actor: concurrent streams, not threads
    ).remote(config, workers, eos_token_ids, router_config, admission_config, worker_labels=worker_labels,
             elastic=elastic, lora_adapters=lora_adapters)
