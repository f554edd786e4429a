"""The Ray Serve application: `build_app(args)` -> ingress (N replicas) + engine supervisor.

    OpenAIIngress (FastAPI, N replicas) --- SchedulerActor handle ---> SchedulerActor
         |  asks once at start                                          |  one call per step
         v                                                              v
    EngineSupervisor (1 replica) ---- creates and owns ----> WorkerActor x num_workers

Why a supervisor deployment owns the actors instead of build_app creating them: under
`serve deploy` (and `serve run` of a YAML file) build_app runs inside a short-lived build
task, and a non-detached actor dies with the process that created it. Owned by a Serve
replica, the scheduler and workers live exactly as long as the application: deleting
or redeploying the app removes them, and Ray restarts them (max_restarts) while it lives.
The supervisor checks the cluster's resources before creating anything (fail fast, never
DEPLOYING forever) and waits for the workers with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from serve_app.api import create_api
from serve_app.config import AppArgs, ResourceError, ResourcePlan, plan_resources
from serve_app.context import ServingContext
from serve_app.engine_client_ray import RayEngineClient
from serve_app.health import HealthConfig, HealthMonitor
from serve_app.model_card import ModelCard
from serve_app.tokenizer import TokenizerService
from scheduler.actor import ACTOR_NAMESPACE, create_scheduler, scheduler_actor_name
from scheduler.config import SchedulerConfig
from workers.actor import WorkerResources, create_worker, worker_actor_name

logger = logging.getLogger(__name__)


def package_version() -> str:
    try:
        return metadata.version("rayllm-serve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def runner_kwargs(args: AppArgs, plan: ResourcePlan) -> dict[str, Any]:
    """workers.model_runner.RunnerConfig fields (threads and device are set by create_worker)."""
    return {
        "model": args.model,
        "model_cache_dir": args.model_cache_dir,
        "dtype": args.dtype or ("bfloat16" if plan.worker_num_gpus else "float32"),
        "block_size": args.block_size,
        "num_blocks": args.num_kv_blocks,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_model_len": args.max_model_len,
        "seed": args.seed,
    }


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class EngineSupervisor:
    """Creates (or finds by name) the workers and the scheduler, and owns their lifetime."""

    async def __init__(self, args: dict[str, Any]) -> None:
        self._args = AppArgs.model_validate(args)
        plan = plan_resources(self._args, ray.cluster_resources())
        self._workers = self._create_workers(plan)
        infos = await self._wait_for_workers()
        self._model_info = infos[0]
        self._scheduler = self._create_scheduler(infos)
        await self._scheduler.ready.remote()
        logger.info("engine ready: %d workers, %s", len(self._workers), self._model_info)

    def _create_workers(self, plan: ResourcePlan) -> list[Any]:
        available = ray.available_resources()
        needed = plan.worker_num_cpus * self._args.num_workers + self._args.scheduler_num_cpus
        if needed > available.get("CPU", 0.0) + 1e-9:
            raise ResourceError(
                f"the workers and scheduler need {needed:g} CPUs but only "
                f"{available.get('CPU', 0.0):g} are free in the cluster (other apps hold the rest)"
            )
        resources = WorkerResources(plan.worker_num_cpus, plan.worker_num_gpus)
        kwargs = runner_kwargs(self._args, plan)
        return [
            create_worker(
                kwargs, resources, name=worker_actor_name(self._args.name, index), namespace=ACTOR_NAMESPACE
            )
            for index in range(self._args.num_workers)
        ]

    async def _wait_for_workers(self) -> list[Any]:
        timeout = self._args.startup_timeout_s
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(worker.model_info.remote() for worker in self._workers)), timeout
            )
        except asyncio.TimeoutError:
            raise ResourceError(
                f"the {len(self._workers)} workers did not load the model within {timeout:g}s "
                "(startup_timeout_s); check the worker logs and the cluster's free resources"
            ) from None

    def _create_scheduler(self, infos: list[Any]) -> Any:
        args = self._args
        config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            block_size=infos[0].block_size,
            num_blocks=min(info.num_blocks for info in infos),
            max_model_len=min(info.max_model_len for info in infos),
            enable_prefix_caching=args.enable_prefix_caching,
        )
        return create_scheduler(
            config, self._workers, tuple(infos[0].eos_token_ids),
            name=scheduler_actor_name(args.name), num_cpus=args.scheduler_num_cpus,
        )

    async def engine(self) -> dict[str, Any]:
        """What an ingress replica needs: the scheduler handle and the model info."""
        return {"scheduler": self._scheduler, "model_info": self._model_info}


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    """The HTTP edge; its FastAPI app comes from serve_app.api.create_api."""

    async def __init__(self, supervisor: DeploymentHandle, args: dict[str, Any]) -> None:
        self._args = AppArgs.model_validate(args)
        engine = await supervisor.engine.remote()
        info, scheduler = engine["model_info"], engine["scheduler"]
        loop = asyncio.get_running_loop()
        model_dir = await loop.run_in_executor(None, self._local_model_dir, info.model_path)
        tokenizer = await loop.run_in_executor(None, TokenizerService.from_model_dir, model_dir)
        client = RayEngineClient(scheduler)
        self._health = HealthMonitor(client.status, HealthConfig(step_deadline_s=self._args.step_deadline_s))
        await self._health.poll_once()
        self._health.start()
        card = ModelCard(
            served_name=self._args.served_model_name or Path(info.model_path).name,
            root=str(info.model_path),
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            created=int(time.time()),
        )
        self._ctx = ServingContext(tokenizer, client, card, health=self._health, version=package_version())

    def _local_model_dir(self, worker_model_path: str) -> str:
        """The worker's model directory, or this node's copy when the ingress runs elsewhere."""
        if Path(worker_model_path, "config.json").is_file():
            return worker_model_path
        from workers.loader import resolve_model_path  # converts the default model on this node

        return str(resolve_model_path(self._args.model, self._args.model_cache_dir))

    def __serve_build_asgi_app__(self) -> Any:
        return create_api(self._ctx)


def build_app(args: dict[str, Any]) -> Application:
    """The application from validated args; checks resources now when Ray is up."""
    app_args = AppArgs.model_validate(args or {})
    if ray.is_initialized():
        plan_resources(app_args, ray.cluster_resources())
    plain_args = app_args.model_dump()
    supervisor = EngineSupervisor.options(name=f"{app_args.name}-engine").bind(plain_args)
    ingress = OpenAIIngress.options(
        name=f"{app_args.name}-ingress",
        num_replicas=app_args.ingress_replicas,
        ray_actor_options={"num_cpus": app_args.ingress_num_cpus},
        max_ongoing_requests=app_args.ingress_max_ongoing_requests,
    )
    return ingress.bind(supervisor, plain_args)
