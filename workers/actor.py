"""WorkerActor: the Ray shell over one ModelRunner (weights, KV pool, sampler).

execute() runs in the actor's default concurrency group (one at a time: the runner is not
re-entrant); model_info() and ping() run in a separate "control" group so they answer
while a long step is running. ping() returns this process's incarnation id, so the
scheduler can tell a restarted worker (empty KV pool) from the one it knew.

A scheduler on the same node steps the worker over a Unix socket instead (StepServer,
workers/step_server.py; scheduler/step_channel.py says why): step_address() tells it where.
One lock serializes the runner between that socket's thread and Ray's calls.

Sizing: on a GPU node the worker takes num_gpus=1; otherwise it takes num_cpus and sets
torch's threads to floor(num_cpus) explicitly (OMP_NUM_THREADS too, before torch loads).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import threading
import uuid
from pathlib import PurePath
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from scheduler.outputs import ModelRunnerOutput, SchedulerOutput, WorkerStateLostError

CONTROL_GROUP = "control"
# The states a worker's repr shows: starting until its model is loaded, then serving, and
# draining once the scheduler says so (set_state).
WORKER_STATES = ("starting", "serving", "draining")
logger = logging.getLogger(__name__)


def describe_worker(model: Any, device: Any, dtype: Any, state: Any) -> str:
    """`WorkerActor(model=<dir name>, device=..., dtype=..., state=...)`, what the Ray dashboard's
    actor list shows; `model` is a path (its last part is shown) or None (the default model)."""
    name = PurePath(str(model)).name if model not in (None, "", "default") else "default"
    return f"WorkerActor(model={name}, device={device}, dtype={dtype}, state={state})"


@ray.remote(concurrency_groups={CONTROL_GROUP: 1})
class WorkerActor:
    """Options (resources, name, restarts) are given at creation: see create_worker."""

    def __init__(self, runner_kwargs: dict[str, Any]) -> None:
        # what __repr__ shows: the asked-for model, device and dtype until the runner resolves them
        self._identity = (runner_kwargs.get("model"), runner_kwargs.get("device", "cpu"),
                          runner_kwargs.get("dtype", "auto"))
        self._state = "starting"
        # torch loads here, in the worker process, after OMP_NUM_THREADS is set; the
        # processes that create workers never import torch.
        from workers.model_runner import ModelRunner, RunnerConfig

        from workers.step_server import StepServer

        self._runner = ModelRunner(RunnerConfig(**runner_kwargs))
        info = self._runner.model_info
        self._identity = (info.model_path, info.device, info.dtype)
        self._state = "serving"
        self._incarnation = uuid.uuid4().hex
        self._runner_lock = threading.Lock()
        try:
            self._step_server: StepServer | None = StepServer(self._execute_locked)
        except OSError as error:  # no usable temp dir: the scheduler steps us with Ray calls
            logger.warning("no step socket (%r): steps come as Ray calls", error)
            self._step_server = None

    def __repr__(self) -> str:
        """Model, device, dtype and state; Ray records it for the dashboard's actor list when
        __init__ returns (so it shows serving there). Reads two attributes; never raises."""
        try:
            identity = getattr(self, "_identity", (None, "?", "?"))
            return describe_worker(*identity, getattr(self, "_state", "starting"))
        except Exception:  # a repr must not fail: Ray calls it for logs and the dashboard
            return "WorkerActor(?)"

    @ray.method(concurrency_group=CONTROL_GROUP)
    def set_state(self, state: str) -> None:
        """What the scheduler says this worker is doing: serving, or draining before it goes
        away (shown by __repr__). starting is the state before the model is loaded."""
        if state not in WORKER_STATES:
            raise ValueError(f"worker state must be one of {', '.join(WORKER_STATES)}, not {state!r}")
        self._state = state

    def execute(self, scheduler_output: SchedulerOutput, incarnation: str | None = None) -> ModelRunnerOutput:
        """One step. `incarnation`: the one the scheduler's block accounting belongs to; a
        step meant for an earlier incarnation (this worker restarted since) is refused."""
        if incarnation is not None and incarnation != self._incarnation:
            raise WorkerStateLostError(f"this worker restarted: step was for incarnation {incarnation}")
        return self._execute_locked(scheduler_output)

    def _execute_locked(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        with self._runner_lock:
            return self._runner.execute(scheduler_output)

    def reset(self) -> None:
        """Drops every request state (a restarted scheduler starts from nothing). Runs in
        the default group, so never during a Ray step; the lock keeps it off a socket step."""
        with self._runner_lock:
            self._runner.reset()

    def step_address(self) -> tuple[str, str | None, str]:
        """(node id, Unix socket path or None, incarnation) of this worker's step channel. In
        the default group on purpose: it answers after every call the caller sent before it
        (reset, Ray steps), so steps sent on the socket after it cannot overtake them."""
        path = self._step_server.path if self._step_server is not None else None
        return ray.get_runtime_context().get_node_id(), path, self._incarnation

    @ray.method(concurrency_group=CONTROL_GROUP)
    def model_info(self) -> Any:
        return self._runner.model_info

    @ray.method(concurrency_group=CONTROL_GROUP)
    def check_lora(self, name: str, path: str) -> dict[str, int]:
        """Loads the adapter at path to check it fits this model, and drops it (a run-time load
        is checked here before any request may name it). Raises LoraError with the reason."""
        return self._runner.check_lora(name, path)

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> str:
        return self._incarnation

    @ray.method(concurrency_group=CONTROL_GROUP)
    def node_info(self) -> dict[str, str]:
        """Where this worker runs (for /v1/server_info)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    @ray.method(concurrency_group=CONTROL_GROUP)
    def node_id(self) -> str:
        """The Ray node this worker runs on (placement checks, admin views)."""
        return ray.get_runtime_context().get_node_id()


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerResources:
    num_cpus: float  # logical CPUs reserved; torch threads = floor(num_cpus) on CPU workers
    num_gpus: int  # 1 on GPU nodes, else 0
    num_threads_override: int | None = None  # torch threads if set; None: floor(num_cpus)

    @property
    def num_threads(self) -> int:
        if self.num_threads_override is not None:
            return self.num_threads_override
        return max(1, math.floor(self.num_cpus))

    @property
    def device(self) -> str:
        return "cuda" if self.num_gpus else "cpu"


def worker_actor_name(app_name: str, index: int | str) -> str:
    return f"{app_name}-worker-{index}"


def create_worker(
    runner_kwargs: dict[str, Any],
    resources: WorkerResources,
    *,
    name: str,
    namespace: str | None = None,
    max_restarts: int = 3,
    scheduling_strategy: Any = None,
) -> Any:
    """A named WorkerActor (or the live one of that name) holding a ModelRunner.

    runner_kwargs are workers.model_runner.RunnerConfig's fields; threads and device come
    from `resources`. scheduling_strategy: e.g. a PlacementGroupSchedulingStrategy that pins
    the worker to its bundle (multi-node spreading); None: Ray's default placement.
    """
    config = {**runner_kwargs, "num_threads": resources.num_threads, "device": resources.device}
    return WorkerActor.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        num_cpus=resources.num_cpus,
        num_gpus=resources.num_gpus,
        max_restarts=max_restarts,
        scheduling_strategy=scheduling_strategy,
        runtime_env={"env_vars": openmp_env(resources.num_threads)},
    ).remote(config)


# AppArgs.worker_placement -> Ray placement group strategy ("none": no placement group)
PLACEMENT_STRATEGIES = {"spread": "SPREAD", "strict_spread": "STRICT_SPREAD", "pack": "PACK"}


@dataclasses.dataclass(frozen=True)
class WorkerFleet:
    """An app's workers from start to end, one place for the app builder (the starting workers,
    placed together by a placement group) and the scheduler actors (elastic workers, added one
    at a time with the same placement rule, and retired): what a worker is made of, its name,
    where it goes and how it ends."""

    runner_kwargs: dict[str, Any]  # workers.model_runner.RunnerConfig's fields
    resources: WorkerResources
    bundle: dict[str, float]  # one worker's resources as a placement group bundle (serve_app.config.worker_bundle)
    app_name: str
    namespace: str | None = None
    placement: str = "none"  # AppArgs.worker_placement: none, pack, spread or strict_spread

    async def reserve(self, count: int, timeout_s: float) -> Any:
        """A placement group of `count` worker bundles, spread or packed over the nodes as the
        placement says, once Ray has made it; None for placement "none". TimeoutError (the group
        removed) when the nodes cannot hold it within timeout_s."""
        strategy = PLACEMENT_STRATEGIES.get(self.placement)
        if strategy is None:
            return None
        group = placement_group([self.bundle] * count, strategy=strategy)
        try:
            await asyncio.wait_for(group.ready(), timeout_s)
        except asyncio.TimeoutError:
            remove_placement_group(group)
            raise
        return group

    def create(self, name: str, group: Any = None, bundle_index: int = -1) -> Any:
        """Worker `name` (worker_actor_name's suffix), in bundle `bundle_index` of `group` when given."""
        return self._start(name, None if group is None else PlacementGroupSchedulingStrategy(group, bundle_index))

    def spawn(self, name: str, worker_nodes: list[str]) -> Any:
        """An elastic worker, placed by the same rule as the starting ones. worker_nodes: the nodes
        of the app's live workers that the caller knows of (ids, repeats counted)."""
        if self.placement not in PLACEMENT_STRATEGIES:  # "none": Ray's choice, no need to look at the nodes
            return self._start(name, None)
        alive = [node for node in ray.nodes() if node.get("Alive")]
        node = node_for_new_worker(self.placement, alive, worker_nodes, self.bundle)
        if node is not None:
            return self._start(name, NodeAffinitySchedulingStrategy(node, soft=self.placement != "strict_spread"))
        if self.placement == "strict_spread":
            logger.warning("worker %s: no node without a worker of this app has room for %s; it goes where "
                           "Ray has room (strict_spread resumes once a node joins)", name, self.bundle)
        return self._start(name, "SPREAD" if self.placement in ("spread", "strict_spread") else None)

    def _start(self, name: str, scheduling_strategy: Any) -> Any:
        return create_worker(self.runner_kwargs, self.resources, name=worker_actor_name(self.app_name, name),
                             namespace=self.namespace, scheduling_strategy=scheduling_strategy)

    @staticmethod
    def retire(worker: Any) -> None:
        """Ends a worker the scheduler has drained (its requests finished or moved)."""
        ray.kill(worker)


def node_for_new_worker(placement: str, nodes: list[dict[str, Any]], worker_nodes: list[str],
                        bundle: dict[str, float]) -> str | None:
    """The node an elastic worker should go to, or None for Ray's choice. nodes: ray.nodes()
    entries of live nodes (NodeID, Resources: their totals); worker_nodes: the node ids of the
    app's workers, one entry per worker. pack: the node with the most workers that still holds
    one more; spread and strict_spread: a node holding one more with the fewest workers (none
    for strict_spread, else None). A node's room is its total less what the app's workers there
    take (other apps' use is Ray's to weigh: the affinity is soft but for strict_spread)."""
    if placement not in PLACEMENT_STRATEGIES:
        return None
    counts = {node["NodeID"]: worker_nodes.count(node["NodeID"]) for node in nodes}

    def holds_one_more(node: dict[str, Any]) -> bool:
        total = node.get("Resources", {})
        return all(total.get(key, 0.0) + 1e-9 >= need * (counts[node["NodeID"]] + 1) for key, need in bundle.items())

    fitting = [node["NodeID"] for node in nodes if holds_one_more(node)]
    if placement == "strict_spread":
        fitting = [node for node in fitting if counts[node] == 0]
    if not fitting:
        return None
    if placement == "pack":
        return max(fitting, key=lambda node: counts[node])
    return min(fitting, key=lambda node: counts[node])


def openmp_env(num_threads: int) -> dict[str, str]:
    """The worker's OpenMP settings. PASSIVE: idle threads sleep instead of spinning, so between
    steps they leave the cores to the ingress and scheduler (unbounded spinning made steps 5-8x
    slower under load). With 2+ threads, a bounded spin (GOMP_SPINCOUNT) before sleeping: a step
    runs hundreds of parallel regions, and waking sleeping threads for each cost more than the
    second thread gave (bench_runner --breakdown, bf16, 2 threads: batch 1 18.8 -> 10.7 ms,
    batch 16 46.8 -> 36.3 ms)."""
    threads = str(num_threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OMP_WAIT_POLICY": "PASSIVE"}
    if num_threads > 1:
        env["GOMP_SPINCOUNT"] = "100000"
    return env
