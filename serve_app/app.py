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
import dataclasses
import functools
import gc
import logging
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from ray.util.placement_group import PlacementGroup
from pydantic import SecretStr

from serve_app.api import create_api
from serve_app.auth import api_keys_from_env
from serve_app.config import (
    LAUNCH_DEFAULTS,
    AppArgs,
    ResourceError,
    ResourcePlan,
    check_placement,
    plan_resources,
    worker_bundle,
)
from serve_app.context import ServingContext
from serve_app.data_plane import report_data_plane
from serve_app.engine_client_ray import RayEngineClient
from serve_app.health import HealthConfig, HealthMonitor
from serve_app.metrics import INGRESS_METRICS, EngineStatsCache, IngressMetrics
from serve_app.lora_api import sync_adapters
from serve_app.model_card import ModelCard
from serve_app.observability import Observability
from serve_app.reasoning import THINK_CLOSE, THINK_OPEN, choose_reasoning_parser
from serve_app.resume import ResumingEngineClient
from serve_app.sampling_defaults import read_sampling_defaults
from serve_app.sharding import ShardedEngineClient
from serve_app.tokenizer import TokenizerService
from serve_app.tool_parsers import choose_tool_call_parser
from scheduler.actor import ACTOR_NAMESPACE, ElasticWorkers, RayMetrics, create_scheduler, scheduler_actor_name
from workers.actor import PLACEMENT_STRATEGIES, WorkerFleet, WorkerResources
from workers.config import ModelConfig

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
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "block_size": args.block_size,
        "num_blocks": args.num_kv_blocks,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_model_len": args.max_model_len,
        "attention_backend": args.attention_backend,
        "cuda_graph_batch_sizes": (args.cuda_graph_batch_sizes if args.cuda_graph_batch_sizes == "auto"
                                   else tuple(args.cuda_graph_batch_sizes)),
        "seed": args.seed,
        "lora_adapters": tuple(args.lora_adapters.items()),
        "max_lora_rank": args.max_lora_rank,
        "max_num_seqs": args.max_num_seqs,
        "state_snapshots": args.state_snapshots,
        "measure_step_costs": True,  # the scheduler's prompt-batching rules follow them (scheduler/step_costs.py)
    }


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
class EngineSupervisor:
    """Creates (or finds by name) the workers and the scheduler, and owns their lifetime."""

    async def __init__(self, args: dict[str, Any]) -> None:
        self._args = AppArgs.model_validate(args)
        plan = plan_resources(self._args, ray.cluster_resources())
        self._check_free_resources(plan)
        resources = WorkerResources(plan.worker_num_cpus, plan.worker_num_gpus, self._args.worker_num_threads)
        self._fleet = WorkerFleet(runner_kwargs(self._args, plan), resources, worker_bundle(plan), self._args.name,
                                  ACTOR_NAMESPACE, self._args.worker_placement)
        self._placement_group = await self._reserve_placement()
        self._workers = [self._fleet.create(str(index), self._placement_group, index)
                         for index in range(self._args.num_workers)]
        infos = await self._wait_for_workers()
        self._model_info = infos[0]
        self._schedulers = self._create_schedulers(infos)  # one per shard
        self._scheduler = self._schedulers[0]
        await asyncio.gather(*(scheduler.ready.remote() for scheduler in self._schedulers))
        logger.info("engine ready: %d workers, %d scheduler shards, %s",
                    len(self._workers), len(self._schedulers), self._model_info)

    def _check_free_resources(self, plan: ResourcePlan) -> None:
        args = self._args
        available = ray.available_resources()
        needed = plan.worker_num_cpus * args.num_workers + args.scheduler_num_cpus * args.num_scheduler_shards
        if needed > available.get("CPU", 0.0) + 1e-9:
            raise ResourceError(
                f"the workers and schedulers need {needed:g} CPUs but only "
                f"{available.get('CPU', 0.0):g} are free in the cluster (other apps hold the rest)"
            )
        if args.worker_placement != "none":
            nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
            check_placement(args, plan, nodes)

    async def _reserve_placement(self) -> PlacementGroup | None:
        """One bundle per starting worker (its CPUs, or 1 GPU on GPU nodes), spread over the nodes
        as worker_placement says; None for worker_placement=none. Fails after startup_timeout_s."""
        try:
            return await self._fleet.reserve(self._args.num_workers, self._args.startup_timeout_s)
        except asyncio.TimeoutError:
            raise ResourceError(
                f"could not place {self._args.num_workers} workers of {self._fleet.bundle} with "
                f"{PLACEMENT_STRATEGIES[self._args.worker_placement]} within {self._args.startup_timeout_s:g}s; "
                "check the nodes' free resources"
            ) from None

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

    def _create_schedulers(self, infos: list[Any]) -> list[Any]:
        """One SchedulerActor per shard, each owning its slice of the workers."""
        args = self._args
        config = args.scheduler_config(
            block_size=infos[0].block_size,
            num_blocks=min(info.num_blocks for info in infos),
            max_model_len=min(info.max_model_len for info in infos),
            step_costs=infos[0].step_costs,
            recurrent_state=infos[0].has_recurrent_state,
            num_state_snapshots=min(info.num_state_snapshots for info in infos),
        )
        self._prefill_rules = {name: {"value": value, "from": source} for name, (value, source) in
                               args.prefill_rule_sources(infos[0].step_costs, infos[0].block_size).items()}
        logger.info("prompt batching (scheduler/step_costs.py): %s", self._prefill_rules)
        return [
            create_scheduler(
                config, [self._workers[index] for index in indices], tuple(infos[0].eos_token_ids),
                name=scheduler_actor_name(args.name, shard), num_cpus=args.scheduler_num_cpus,
                router_config=args.router_config(), admission_config=args.admission_config(),
                worker_labels=[str(index) for index in indices], elastic=self._elastic_workers(shard),
                lora_adapters=dict(args.lora_adapters),
            )
            for shard, indices in enumerate(args.shard_worker_indices())
        ]

    def _elastic_workers(self, shard: int) -> ElasticWorkers | None:
        """Shard `shard`'s share of the autoscaling bounds and the fleet its workers come from;
        None without autoscaling."""
        args = self._args
        autoscale = args.autoscale_config(shard)
        if autoscale is None:
            return None
        prefix = f"{shard}." if args.num_scheduler_shards > 1 else ""
        return ElasticWorkers(autoscale, self._fleet, prefix, drain_timeout_s=args.drain_timeout_s,
                              wake_timeout_s=args.startup_timeout_s)

    async def engine(self) -> dict[str, Any]:
        """What an ingress replica needs: the scheduler handle(s) and the model info.

        "scheduler" is shard 0's handle; "schedulers" lists every shard's, by shard index.
        """
        return {"scheduler": self._scheduler, "schedulers": self._schedulers, "model_info": self._model_info,
                "prefill_rules": self._prefill_rules}

    async def __del__(self) -> None:
        """Serve calls this on app deletion or redeploy, before the actors this replica owns
        die with it: the schedulers refuse new requests (503, /health 503) and in-flight ones
        get drain_timeout_s to finish (graceful_shutdown_timeout_s leaves room for it). A replica
        whose start failed before it had schedulers has nothing to drain."""
        timeout = self._args.drain_timeout_s
        results = await asyncio.gather(
            *(scheduler.drain.remote(timeout) for scheduler in getattr(self, "_schedulers", ())),
            return_exceptions=True,
        )
        logger.info("drained the engine: %s requests aborted at the deadline", results)


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
        schedulers = engine.get("schedulers") or [scheduler]
        client = self._engine_client(schedulers, info.block_size)
        observability = self._observability(schedulers)
        # One poll per period and shard (published_stats) feeds /health, /metrics and /v1/server_info.
        self._health = HealthMonitor(observability.engine_stats.fetch_status, HealthConfig(
            poll_interval_s=self._args.metrics_poll_interval_s, step_deadline_s=self._args.step_deadline_s))
        await self._health.poll_once()  # a fresh /metrics lists the engine's families too
        self._health.start()
        card = ModelCard(
            served_name=self._args.served_model_name or Path(info.model_path).name,
            root=str(info.model_path),
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=tuple(info.eos_token_ids),
            created=int(time.time()),
            backend={"device": info.device, "dtype": info.dtype, "kv_cache_dtype": info.kv_cache_dtype,
                     "attention_backend": info.attention_backend,
                     "cuda_graph_batch_sizes": list(info.cuda_graph_batch_sizes), "model_type": info.model_type,
                     "layer_loop": info.layer_loop, "layer_ops": info.layer_ops,
                     "linear_backend": info.linear_backend, "quantization": info.quantization,
                     "isa": dict(info.isa), "lora": info.lora, "kv_cache_kind": info.kv_cache_kind,
                     "step_costs": None if info.step_costs is None else dataclasses.asdict(info.step_costs)},
            reasoning_parser=choose_reasoning_parser(tokenizer.chat_template, self._args.reasoning_parser,
                                                     tokenizer.keeps_text(THINK_OPEN + "x" + THINK_CLOSE)),
            tool_call_parser=choose_tool_call_parser(tokenizer.chat_template, self._args.tool_call_parser),
            sampling_defaults=read_sampling_defaults(model_dir) if self._args.generation_config == "auto" else {},
            lora_adapters=tuple(self._args.lora_adapters.items()),
        )
        self._ctx = ServingContext(tokenizer, client, card, health=self._health, version=package_version(),
                                   limits=self._args.server_limits(), observability=observability,
                                   stream_interval=self._args.stream_interval,
                                   fast_data_plane=report_data_plane().as_json(),  # warns once when off
                                   prefill_rules=engine.get("prefill_rules"),
                                   allow_runtime_lora_updates=self._args.allow_runtime_lora_updates)
        observability.engine_stats.on_refresh = functools.partial(sync_adapters, self._ctx)
        # Startup objects (tokenizer, FastAPI, Ray, transformers: ~10^5) leave the GC's scans:
        # a full collection over them paused this replica's loop for 100-300 ms under load.
        gc.freeze()

    def _engine_client(self, schedulers: list[Any], block_size: int) -> Any:
        """One RayEngineClient per scheduler shard, each resuming its requests after a restart
        of its scheduler (resume.py); several: a ShardedEngineClient over them."""
        args = self._args
        clients = [
            ResumingEngineClient(RayEngineClient(scheduler), args.max_resumes, args.resume_timeout_s)
            for scheduler in schedulers
        ]
        if len(clients) == 1:
            return clients[0]
        return ShardedEngineClient(clients, block_size, self._args.shard_hash_blocks)

    def _observability(self, schedulers: list[Any]) -> Observability:
        """Ingress metrics into Ray's export too, and the schedulers' published stats, refreshed
        by the health monitor's poll, for /metrics and /v1/server_info (Serve's proxy echoes
        x-request-id)."""
        fetchers = [scheduler.published_stats.remote for scheduler in schedulers]
        engine_stats = EngineStatsCache(fetchers)  # refreshed by the health monitor's poll
        metrics = IngressMetrics([RayMetrics(INGRESS_METRICS)])
        return Observability(metrics=metrics, engine_stats=engine_stats, echo_request_id=False)

    def _local_model_dir(self, worker_model_path: str) -> str:
        """The worker's model directory, or this node's copy when the ingress runs elsewhere."""
        if Path(worker_model_path, "config.json").is_file():
            return worker_model_path
        from workers.loader import resolve_model_path  # converts the default model on this node

        return str(resolve_model_path(self._args.model, self._args.model_cache_dir))

    def __serve_build_asgi_app__(self) -> Any:
        return create_api(self._ctx, [key.get_secret_value() for key in self._args.api_keys])

    async def __del__(self) -> None:
        """Serve has drained this replica's requests (graceful_shutdown_timeout_s); anything
        still arriving (a kept-alive connection) gets 503 and /health says draining."""
        if hasattr(self, "_ctx"):
            self._ctx.draining = True


def check_local_model(model: str | None) -> None:
    """Reads a local checkpoint's config.json now, so that one we cannot serve (a family we do
    not know, a quantized one) fails the build with one line (ModelConfigError) instead of
    failing each worker's constructor, retried by Serve, behind a traceback in the status.
    The default model and a path this node lacks (only the worker nodes have it) are left to
    the workers."""
    if model is not None and Path(model, "config.json").is_file():
        ModelConfig.from_model_dir(Path(model))
    elif model is not None and Path(model).suffix.lower() == ".gguf" and Path(model).is_file():
        from workers.gguf_checkpoint import gguf_architecture  # raises GgufCheckpointError, one line

        gguf_architecture(model)


def build_app(args: dict[str, Any]) -> Application:
    """The application from validated args; checks the model's config and, when Ray is up, the
    resources now."""
    app_args = AppArgs.model_validate({**LAUNCH_DEFAULTS, **(args or {})})
    check_local_model(app_args.model)
    if not app_args.api_keys:  # the one environment read: keys travel on as SecretStr args
        app_args.api_keys = [SecretStr(key) for key in api_keys_from_env()]
    if ray.is_initialized():
        plan_resources(app_args, ray.cluster_resources())
    # the fields the config set (and api_keys, if read here): the deployments validate them again, and a
    # field left out keeps meaning "not set" there (the prompt-batching knobs then follow the step costs)
    plain_args = app_args.model_dump(exclude_unset=True)
    grace_s = app_args.drain_timeout_s + 10.0  # Serve force-kills a replica after this
    supervisor = EngineSupervisor.options(
        name=f"{app_args.name}-engine", graceful_shutdown_timeout_s=grace_s
    ).bind(plain_args)
    ingress = OpenAIIngress.options(
        name=f"{app_args.name}-ingress",
        **app_args.ingress_scaling(),  # num_replicas, or Serve's autoscaling_config for a range
        ray_actor_options={"num_cpus": app_args.ingress_num_cpus},
        max_ongoing_requests=app_args.ingress_max_ongoing_requests,
        graceful_shutdown_timeout_s=grace_s,
    )
    return ingress.bind(supervisor, plain_args)
