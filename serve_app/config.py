"""App arguments (pydantic, validated once at the edge) and the up-front resource plan.

Ray hangs silently (deployments stay DEPLOYING) when an actor asks for more than the
cluster has, so plan_resources() checks the whole app against the cluster's resources
before anything is created and fails with a message that says what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

GIB = 1 << 30


class AppArgs(BaseModel):
    """Arguments of build_app (YAML `args:` or `serve run ... key=value`)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(
        None, description="Local Hugging Face model directory; null or 'default' is SmolLM2-135M-Instruct."
    )
    model_cache_dir: str | None = Field(
        None, description="Where the default model is converted to safetensors (null: ~/.cache/rayllm)."
    )
    served_model_name: str | None = Field(
        None, description="The id clients use in 'model'; null: the model directory's name."
    )
    name: str = Field(
        "rayllm", pattern=r"^[A-Za-z0-9_.-]+$",
        description="Prefix of the Ray actor names; unique per application in a cluster.",
    )
    num_workers: int = Field(1, ge=1, le=64, description="Worker actors, each a full model replica.")
    worker_num_cpus: float = Field(
        1.0, gt=0, description="Logical CPUs per worker; torch threads = floor(worker_num_cpus)."
    )
    worker_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: one GPU per worker when the cluster has enough GPUs, else CPU."
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights and KV dtype; null: float32 on CPU, bfloat16 on GPU."
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_kv_blocks: int | None = Field(
        None, ge=2, description="KV blocks per worker (block 0 is reserved); null: from kv_cache_memory_gb."
    )
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="KV pool size per worker when num_kv_blocks is null.")
    max_model_len: int | None = Field(
        None, ge=2, description="Tokens per sequence (prompt + output); null: the model's own limit."
    )
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one engine step.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences in one worker's running batch at most.")
    enable_prefix_caching: bool = Field(True, description="Reuse computed prompt blocks across requests.")
    ingress_replicas: int = Field(1, ge=1, le=64, description="Replicas of the HTTP ingress deployment.")
    ingress_num_cpus: float = Field(0.25, ge=0, description="Logical CPUs per ingress replica.")
    ingress_max_ongoing_requests: int = Field(
        1024, ge=1, description="Concurrent requests one ingress replica accepts (Serve's limit)."
    )
    scheduler_num_cpus: float = Field(0.25, ge=0, description="Logical CPUs of the scheduler actor.")
    startup_timeout_s: float = Field(
        900.0, gt=0, description="Seconds to wait for the workers to load the model before failing."
    )
    step_deadline_s: float = Field(
        60.0, gt=0, description="/health turns 503 when work is pending and no step completed this long."
    )
    seed: int = Field(0, description="Seed of the workers' generator for unseeded requests.")

    @property
    def kv_cache_memory_bytes(self) -> int:
        return int(self.kv_cache_memory_gb * GIB)


class ResourceError(RuntimeError):
    """The cluster cannot host the app as configured; the message says what to change."""


@dataclass(frozen=True, slots=True)
class ResourcePlan:
    worker_num_cpus: float  # per worker
    worker_num_gpus: int  # per worker: 0 or 1
    total_cpus: float  # the whole app: workers + scheduler + ingress replicas
    total_gpus: int

    @property
    def worker_num_threads(self) -> int:
        return max(1, math.floor(self.worker_num_cpus))


def plan_resources(args: AppArgs, cluster: dict[str, float]) -> ResourcePlan:
    """Checks the app against the cluster's total resources (ray.cluster_resources())."""
    cluster_cpus = cluster.get("CPU", 0.0)
    cluster_gpus = int(cluster.get("GPU", 0.0))
    if args.worker_device == "cuda" and cluster_gpus < args.num_workers:
        raise ResourceError(
            f"worker_device=cuda needs {args.num_workers} GPUs (one per worker) but the cluster has "
            f"{cluster_gpus}; lower num_workers or use worker_device=auto/cpu"
        )
    use_gpu = args.worker_device == "cuda" or (args.worker_device == "auto" and 0 < args.num_workers <= cluster_gpus)
    worker_gpus = 1 if use_gpu else 0
    worker_cpus = min(args.worker_num_cpus, 1.0) if use_gpu else args.worker_num_cpus
    total_cpus = (
        args.num_workers * worker_cpus + args.scheduler_num_cpus + args.ingress_replicas * args.ingress_num_cpus
    )
    if total_cpus > cluster_cpus + 1e-9:
        raise ResourceError(
            f"the app needs {total_cpus:g} CPUs ({args.num_workers} workers x {worker_cpus:g} + scheduler "
            f"{args.scheduler_num_cpus:g} + {args.ingress_replicas} ingress replicas x "
            f"{args.ingress_num_cpus:g}) but the cluster has {cluster_cpus:g}; lower num_workers, "
            f"worker_num_cpus or ingress_replicas, or add nodes"
        )
    return ResourcePlan(worker_cpus, worker_gpus, total_cpus, worker_gpus * args.num_workers)
