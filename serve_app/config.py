"""App arguments (pydantic, validated once at the edge) and the up-front resource plan.

Ray hangs silently (deployments stay DEPLOYING) when an actor asks for more than the
cluster has, so plan_resources() checks the whole app against the cluster's resources
before anything is created and fails with a message that says what to change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from scheduler.admission import AdmissionConfig
from scheduler.autoscale import AutoscaleConfig
from scheduler.config import SchedulerConfig
from scheduler.step_costs import PrefillRules, StepCosts, prefill_rules
from serve_app.ingress_scaling import IngressAutoscaling, max_ingress_replicas, parse_ingress_replicas
from serve_app.limits import ServerLimits
from serve_app.protocol import MAX_N
from serve_app.worker_layout import auto_worker_layout, usable_cpus

from scheduler.router import RouterConfig

GIB = 1 << 30
_ROUTER_DEFAULTS = RouterConfig()


# The app args that follow the workers' step costs when the config leaves them out.
PREFILL_RULE_FIELDS = tuple(field.name for field in dataclasses.fields(PrefillRules))
# What every launch (the shipped YAML, `serve run serve_app.app:build_app ...`, scripts/serve.sh) gets
# where its args leave a field out; AppArgs itself keeps plain defaults, so that tests and tools that
# build it get no layout from the host's CPU count.
LAUNCH_DEFAULTS: dict[str, Any] = {"num_workers": "auto"}


class AppArgs(BaseModel):
    """Arguments of build_app (YAML `args:` or `serve run ... key=value`)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = Field(
        None, description="Local Hugging Face model directory, or a .gguf file (llama architecture); null or "
        "'default' is SmolLM2-135M-Instruct (a Q4_1 GGUF)."
    )
    model_cache_dir: str | None = Field(
        None, description="Where GGUF checkpoints are converted to safetensors, for their config, tokenizer and "
        "dequantized weights (null: ~/.cache/rayllm)."
    )
    served_model_name: str | None = Field(
        None, description="The id clients use in 'model'; null: the model directory's name."
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), as "
        "{name: local directory}: each is listed by /v1/models with the base model as its parent, and a request "
        "selects one with \"model\": \"<name>\". Each is checked at start; a worker loads one when a request needs it, "
        "keeping at most max_cpu_loras (docs/lora.md).",
    )
    max_lora_rank: int = Field(64, ge=1, le=512, description="The highest LoRA rank a worker loads; an adapter of "
                               "a higher rank is refused at start.")
    max_loras: int = Field(4, ge=1, le=256, description="LoRA adapters one engine step may run at most (distinct "
                           "adapters among a worker's running requests); a request of a further adapter waits, "
                           "keeping its place in the queue (docs/lora.md).")
    max_cpu_loras: int = Field(8, ge=1, le=1024, description="LoRA adapters a worker holds loaded at most; when a "
                               "request needs another, the least recently used one no running request uses is "
                               "unloaded. At least max_loras.")
    allow_runtime_lora_updates: bool = Field(False, description="Serve POST /v1/load_lora_adapter and "
                                             "/v1/unload_lora_adapter (vLLM's API), behind the API keys when set; "
                                             "off: those paths are 404.")
    name: str = Field(
        "rayllm", pattern=r"^[A-Za-z0-9_.-]+$",
        description="Prefix of the Ray actor names; unique per application in a cluster.",
    )
    num_workers: int = Field(
        1, ge=1, le=64,
        description="Worker actors, each a full model replica. 'auto' (what every launch gets when the args leave "
        "it out): from this node's CPU, one worker per core on CPUs with native bf16, else one worker with a thread "
        "per core; worker_num_cpus and worker_num_threads follow unless given (serve_app/worker_layout.py).",
    )
    min_workers: int | None = Field(
        None, ge=0, le=64,
        description="Autoscaling (with max_workers): the fewest workers; 0 lets the last one go after "
        "scale_down_delay_s idle, and the next request waits for one to start. null: 1 when max_workers is set.",
    )
    max_workers: int | None = Field(
        None, ge=1, le=64,
        description="Autoscaling: the most workers. null (and min_workers null): a fixed num_workers. With it, "
        "num_workers is the starting count (clamped into [min_workers, max_workers], at least 1).",
    )
    scale_up_delay_s: float = Field(
        30.0, ge=0,
        description="Autoscaling: a worker is added once prompts queue, KV use or queue time stay over target "
        "this long (a shorter burst adds none).",
    )
    scale_down_delay_s: float = Field(
        600.0, ge=0,
        description="Autoscaling: a worker is retired (drained, then its requests migrate) once the load stays "
        "well under target this long.",
    )
    scale_target_waiting_tokens: int = Field(
        8192, ge=1,
        description="Autoscaling target: prompt tokens waiting per serving worker (scheduler/autoscale.py).",
    )
    scale_target_queue_time_s: float = Field(
        2.0, gt=0, description="Autoscaling target: p90 seconds a waiting request has waited to be scheduled.",
    )
    worker_num_cpus: float = Field(
        1.0, gt=0, description="Logical CPUs per worker; torch threads = floor(worker_num_cpus)."
    )
    worker_num_threads: int | None = Field(
        None, ge=1, le=256,
        description="Torch threads per CPU worker; null: floor(worker_num_cpus). More threads than "
        "reserved CPUs suits a small machine where the ingress and scheduler mostly wait.",
    )
    worker_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: one GPU per worker when the cluster has enough GPUs, else CPU."
    )
    attention_backend: Literal["cpu", "torch", "triton"] | None = Field(
        None, description="Attention kernels; null: triton on GPU workers; on CPU our C kernel (cpu), or the "
        "torch reference where no C compiler is found. Reported in /v1/models.",
    )
    cuda_graph_batch_sizes: list[int] | Literal["auto"] = Field(
        "auto", description="Decode batch sizes captured as CUDA graphs (e.g. [1, 2, 4, 8, 16, 32]); empty: off; "
        "auto: 1, 2, 4, ... 256 on GPU workers with the triton backend, off on CPU. Explicit sizes need GPU "
        "workers with the triton backend (workers refuse otherwise). Measured on an H200: docs/gpu.md.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Activations and (unquantized) weights dtype, and the KV pool's but for kv_cache_dtype. "
        "auto: bfloat16 on GPUs and on CPUs with native bf16 (AVX512_BF16 or AMX), float32 on other CPUs; each worker "
        "resolves it on its own node. "
        "A GGUF checkpoint served natively (quantization auto, CPU) keeps its quantized weights: under auto with float32 "
        "activations on every CPU, under bfloat16 with bf16 ones; an explicit float32 serves its dequantized "
        "weights (the exact path). Reported in /v1/models.",
    )
    quantization: Literal["auto", "none"] = Field(
        "auto", description="auto (the default): a GGUF checkpoint (the default model, a .gguf path) is served with "
        "its weights in their GGUF types on CPU workers, unless dtype is float32 (a tenth of the memory; on a 2-core "
        "AVX2 CPU twice the tokens per second of one stream and even at 16, docs/models.md); none: its dequantized "
        "weights are served. "
        "A safetensors checkpoint with a quantization_config (fp8, awq, gptq) is always dequantized at load. "
        "Reported in /v1/models (backend.quantization, e.g. gguf:Q4_1, awq:4bit-g128 (dequantized at load), or none).",
    )
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The KV pool's dtype. auto: under dtype auto, a 16-bit pool on CPU workers (bf16 where "
        "the activations are bf16, fp16 under fp32 activations, as llama.cpp's server keeps its cache: half the "
        "bytes per token to store and to read each decode step, docs/models.md); the activations' dtype otherwise "
        "(an explicit dtype, GPU workers). float16 under float32 activations needs the cpu attention backend. "
        "Reported in /v1/models.",
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_kv_blocks: int | None = Field(
        None, ge=2, description="KV blocks per worker (block 0 is reserved); null: from kv_cache_memory_gb."
    )
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="KV pool size per worker when num_kv_blocks is null.")
    max_model_len: int | None = Field(
        None, ge=2, description="Tokens per sequence (prompt + output); null: the model's own limit."
    )
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one engine step. Left out: from the workers' step costs "
        "(scheduler/step_costs.py: 512 where prompts are cheap, 2048 where they are dear), 2048 without them.",
    )
    long_prefill_token_threshold: int | None = Field(
        512, ge=1,
        description="Prompt tokens one request may take per step (vLLM's knob of the same name): a long prompt is "
        "chunked to this, so running streams wait for one chunk at most, while many short prompts arriving "
        "together still share one step up to max_num_batched_tokens; null: the step budget.",
    )
    max_prefill_tokens_while_decoding: int | None = Field(
        None, ge=1,
        description="Prompt tokens one step may compute, summed over requests, while sequences decode: every "
        "prompt token in a step delays each decoding stream's next token, so this bounds that delay (Sarathi-Serve's "
        "stall-free batching); null: the step budget.",
    )
    long_prefill_tokens_while_decoding: int | None = Field(
        128, ge=1,
        description="While more sequences decode than there are prompts to compute, prompts longer than "
        "long_prefill_token_threshold compute at most this many tokens a step between them, so a long prompt "
        "delays each decoding stream's tokens by a short chunk at a time; shorter prompts are computed whole. "
        "null: no such limit (the threshold per prompt).",
    )
    async_scheduling: bool = Field(
        True,
        description="Decide each step while the worker computes the previous one (vLLM's async scheduling), so "
        "the worker starts the next step without waiting for a round trip through the scheduler; a request that "
        "ends on a stop token costs one wasted position. Greedy and seeded outputs are unchanged.",
    )
    waiting_served_ratio: float = Field(
        0.3, ge=0.0,
        description="Prefill batching while streams decode (TGI's knob of the same name): while a worker runs "
        "sequences, new requests wait until they number at least this share of the running sequences, or the "
        "oldest has waited max_waiting_steps steps, so prompts arriving close together stall the running "
        "streams once instead of once each. 0: every request is admitted at the next step (vLLM's rule).",
    )
    max_waiting_steps: int = Field(
        20, ge=0, description="Steps a new request waits at most under waiting_served_ratio (TGI: max_waiting_tokens).",
    )
    hold_while_finishing_steps: int = Field(
        4, ge=0,
        description="With waiting_served_ratio > 0: while at least half of a worker's running sequences reach "
        "max_tokens within this many steps, new requests wait for them to end (at most max_waiting_steps), so a "
        "prompt does not stall streams that are about to finish; and while at least half of them have sampled "
        "fewer than this many tokens, new requests are not held (they join the batch just started). 0: off.",
    )
    min_shared_prefix_to_wait: int | None = Field(
        256, ge=1,
        description="A new request whose next prompt tokens, this many or more, another request is computing "
        "right now (the same prefix, e.g. one long system prompt in a burst) waits until they are in the prefix "
        "cache, keeping its place in the queue, instead of computing them beside it; shorter shared runs are "
        "computed twice rather than delay it by the step or two before they are cached. null: never wait.",
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences in one worker's running batch at most.")
    state_snapshots: int = Field(
        64, ge=0, description="Models with recurrent layers (LFM2's convolutions, ...): prompt prefixes whose layer "
        "states a worker keeps for prefix-cache hits, one sequence's states each, out of kv_cache_memory_bytes. "
        "0: a repeated prompt is computed again.")
    enable_prefix_caching: bool = Field(True, description="Reuse computed prompt blocks across requests.")
    enable_chunked_prefill: bool = Field(
        True,
        description="Split long prompts over steps, beside running decodes; off: a prompt is computed whole in "
        "one step (the step budget is raised to the model length, as vLLM does), so it stalls every stream.",
    )
    router_policy: Literal["prefix_aware", "round_robin", "least_loaded"] = Field(
        "prefix_aware",
        description="How a scheduler picks a worker for a new request (scheduler/router.py; docs/routing.md).",
    )
    router_balance_abs_threshold: int = Field(
        _ROUTER_DEFAULTS.balance_abs_threshold, ge=0,
        description="prefix_aware: load is imbalanced only if max - min pending tokens exceeds this.",
    )
    router_balance_rel_threshold: float = Field(
        _ROUTER_DEFAULTS.balance_rel_threshold, ge=1.0,
        description="prefix_aware: and only if max pending tokens exceeds this times the min.",
    )
    router_min_match_fraction: float = Field(
        _ROUTER_DEFAULTS.min_match_fraction, ge=0.0, le=1.0,
        description="prefix_aware: a cached match below this share of the prompt counts as no match.",
    )
    router_seq_load_tokens: int = Field(
        _ROUTER_DEFAULTS.seq_load_tokens, ge=0,
        description="Load charged per queued or running sequence, in tokens (its decodes ahead).",
    )
    router_match_in_flight: bool = Field(
        _ROUTER_DEFAULTS.match_in_flight,
        description="prefix_aware: prefixes that queued/running requests will compute count as matched.",
    )
    num_scheduler_shards: int = Field(
        1, ge=1, le=64,
        description="Scheduler actors, each owning num_workers / shards workers; the ingress picks a shard "
        "by a hash of the prompt's first block. More than 1 only when one scheduler actor is the bottleneck.",
    )
    shard_hash_blocks: int = Field(
        1, ge=1, le=1024,
        description="Leading KV blocks of the prompt hashed to pick a scheduler shard (more when every "
        "prompt starts with the same block, e.g. a default system prompt).",
    )
    worker_placement: Literal["spread", "strict_spread", "pack", "none"] = Field(
        "spread",
        description="Placement group strategy of the workers: spread (best effort over nodes), strict_spread "
        "(one worker per node, fails if too few nodes), pack, or none (no placement group).",
    )
    reasoning_parser: Literal["auto", "none", "qwen3", "harmony"] = Field(
        "auto", description="How chat replies' reasoning is parsed into reasoning_content (serve_app/reasoning.py): "
        "auto: harmony when the chat template writes <|channel|>, qwen3 when it writes <think> tags, else none; "
        "none: never (the thought stays in content); qwen3: <think>...</think>; harmony: gpt-oss's analysis "
        "channel. Reported in /v1/models.",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "harmony"] = Field(
        "auto", description="The format of tool calls in 'auto' replies of chat templates that render tools "
        "(serve_app/tool_parsers.py): auto: harmony when the template writes <|channel|> (gpt-oss: read with "
        "the harmony reasoning parser), mistral when it writes [TOOL_CALLS], llama3_json when it "
        "writes <|python_tag|> (or an ipython role with \"parameters\"), else hermes (<tool_call> tags). "
        "Reported in /v1/models.",
    )
    generation_config: Literal["auto", "off"] = Field(
        "auto", description="auto: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty out "
        "gets the model's value from its generation_config.json, as vLLM does (serve_app/sampling_defaults.py); "
        "off: OpenAI's defaults (temperature 1, top_p 1) for every model. Reported in /v1/models.",
    )
    ingress_replicas: Annotated[int, Field(ge=1, le=64)] | IngressAutoscaling = Field(
        1, description="Replicas of the HTTP ingress deployment: a number (fixed), or a range Serve autoscales in: "
        "'MIN-MAX' (e.g. '1-4') or a mapping of Serve's autoscaling_config keys (min_replicas, max_replicas, "
        "target_ongoing_requests, upscale_delay_s, downscale_delay_s; IngressAutoscaling). Resources are checked "
        "for the most replicas.",
    )
    stream_interval: int = Field(
        1, ge=1, le=1024, description="Streamed chunks carry at least this many tokens (a choice's first and last "
        "go at once), as vLLM's --stream-interval: fewer chunks, less serving CPU per token, burstier streams.",
    )
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
    metrics_poll_interval_s: float = Field(
        1.0, gt=0, description="How often each ingress replica refreshes the engine's published stats and "
        "status, one call per scheduler shard (/health, /metrics and /v1/server_info answer from the "
        "latest copy, never waiting on the engine)."
    )
    seed: int = Field(0, description="Seed of the workers' generator for unseeded requests.")
    # --- reliability and security ---
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Keys clients send as 'Authorization: Bearer <key>'; empty: build_app reads the "
        "comma-separated RAYLLM_API_KEYS once; none anywhere: no auth. /health, /live, /metrics stay open.",
    )
    max_request_body_bytes: int = Field(8 << 20, ge=1024, description="Larger request bodies get 413.")
    max_n: int = Field(MAX_N, ge=1, le=MAX_N, description="Sequences per prompt (n) at most.")
    max_choices_per_request: int = Field(256, ge=1, description="Prompts x n of one request at most.")
    max_output_tokens: int | None = Field(
        None, ge=1, description="max_tokens per choice at most (larger: 400; omitted: capped); null: the context."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Prompt tokens at most (more: 400); null: up to the context."
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0, description="Deadline of a request without a 'timeout' field; null: none."
    )
    max_request_timeout_s: float = Field(3600.0, gt=0, description="The longest 'timeout' a request may ask for.")
    max_queued_requests: int | None = Field(
        1024, ge=0, description="Requests queued beyond the running seats, all workers of a shard; more: 429."
    )
    max_queued_tokens: int | None = Field(
        1 << 20, ge=1, description="Prompt tokens waiting to be computed, per shard; more: 429."
    )
    queue_retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429, seconds.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On shutdown, in-flight requests get this long to finish; then they are aborted."
    )
    max_resumes: int = Field(
        3, ge=0, description="Times one request is resubmitted after its scheduler actor died and restarted."
    )
    resume_timeout_s: float = Field(
        60.0, gt=0, description="How long a request waits for a restarted scheduler before failing (503)."
    )

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto_layout(cls, data: object) -> object:
        """num_workers: auto -> numbers, from the CPU of the node this runs on (build_app hands
        the resolved numbers on, so every deployment sees the same ones)."""
        if not isinstance(data, dict) or data.get("num_workers") != "auto":
            return data
        def value(name: str) -> float:
            return float(data.get(name, cls.model_fields[name].default))  # `serve run` args come as text
        reserved = (max_ingress_replicas(data.get("ingress_replicas", 1)) * value("ingress_num_cpus")
                    + value("num_scheduler_shards") * value("scheduler_num_cpus"))
        layout = auto_worker_layout(usable_cpus(), reserved)
        resolved = {**data, "num_workers": layout.num_workers}
        for name in ("worker_num_cpus", "worker_num_threads"):
            if data.get(name) in (None, "auto"):
                resolved[name] = getattr(layout, name)
        return resolved

    @field_validator("ingress_replicas", mode="before")
    @classmethod
    def _parse_ingress_replicas(cls, value: Any) -> Any:
        return parse_ingress_replicas(value)

    @property
    def kv_cache_memory_bytes(self) -> int:
        return int(self.kv_cache_memory_gb * GIB)

    @property
    def max_ingress_replicas(self) -> int:
        return max_ingress_replicas(self.ingress_replicas)

    def ingress_scaling(self) -> dict[str, Any]:
        """The ingress deployment's options: num_replicas, or Serve's autoscaling_config."""
        if isinstance(self.ingress_replicas, IngressAutoscaling):
            return {"autoscaling_config": self.ingress_replicas.serve_config()}
        return {"num_replicas": self.ingress_replicas}

    @model_validator(mode="after")
    def _check_autoscaling(self) -> AppArgs:
        if self.max_workers is None:
            if self.min_workers is not None:
                raise ValueError("min_workers needs max_workers: set both for autoscaling, or neither for a "
                                 "fixed num_workers")
            return self
        low = 1 if self.min_workers is None else self.min_workers
        if low > self.max_workers:
            raise ValueError(f"min_workers={low} exceeds max_workers={self.max_workers}")
        if self.max_workers < self.num_scheduler_shards:
            raise ValueError(f"max_workers={self.max_workers} is below num_scheduler_shards="
                             f"{self.num_scheduler_shards}: each shard scales its own workers, at least one")
        self.num_workers = min(max(self.num_workers, low, 1), self.max_workers)
        return self

    @property
    def autoscaling(self) -> bool:
        return self.max_workers is not None

    def autoscale_config(self, shard: int = 0) -> AutoscaleConfig | None:
        """Shard `shard`'s policy bounds and delays: each shard scales its own workers, between its
        share of min_workers and of max_workers (shares split as the starting workers are, so
        every shard starts within its bounds); None: a fixed num_workers."""
        if self.max_workers is None:
            return None
        low = 1 if self.min_workers is None else self.min_workers
        return AutoscaleConfig(min_workers=shard_share(low, self.num_scheduler_shards, shard),
                               max_workers=shard_share(self.max_workers, self.num_scheduler_shards, shard),
                               scale_up_delay_s=self.scale_up_delay_s,
                               scale_down_delay_s=self.scale_down_delay_s,
                               target_waiting_tokens_per_worker=self.scale_target_waiting_tokens,
                               target_queue_time_s=self.scale_target_queue_time_s,
                               max_running_per_worker=self.max_num_seqs)

    @model_validator(mode="after")
    def _check_lora_names(self) -> AppArgs:
        for name in self.lora_adapters:
            if not name or name == self.served_model_name:
                raise ValueError(f"LoRA adapter name {name!r} must be non-empty and differ from served_model_name")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be at least max_loras={self.max_loras}: a "
                             "worker holds every adapter its step runs")
        return self

    @model_validator(mode="after")
    def _check_shards(self) -> AppArgs:
        if self.num_scheduler_shards > self.num_workers:
            raise ValueError(
                f"num_scheduler_shards={self.num_scheduler_shards} exceeds num_workers={self.num_workers}: "
                "every shard needs at least one worker"
            )
        return self

    def server_limits(self) -> ServerLimits:
        return ServerLimits(
            max_body_bytes=self.max_request_body_bytes,
            max_n=self.max_n,
            max_choices=self.max_choices_per_request,
            max_tokens=self.max_output_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
            default_timeout_s=self.request_timeout_s,
            max_timeout_s=self.max_request_timeout_s,
        )

    def admission_config(self) -> AdmissionConfig:
        return AdmissionConfig(
            max_queued_requests=self.max_queued_requests,
            max_queued_tokens=self.max_queued_tokens,
            max_num_seqs=self.max_num_seqs,
            retry_after_s=self.queue_retry_after_s,
        )

    def scheduler_config(self, *, block_size: int, num_blocks: int, max_model_len: int,
                         step_costs: StepCosts | None = None, recurrent_state: bool = False,
                         num_state_snapshots: int = 0) -> SchedulerConfig:
        """The scheduler's config, given what the workers report about their KV pools and (where
        they measured them) their step costs: the prompt-batching knobs not set in the config follow
        from those (scheduler/step_costs.py), the app's defaults where there are none."""
        rules = self.prefill_rules(step_costs, block_size)
        budget = rules["max_num_batched_tokens"]
        if not self.enable_chunked_prefill:
            budget = max(budget, max_model_len)  # a whole prompt must fit one step, as in vLLM
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs,
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
            long_prefill_tokens_while_decoding=rules["long_prefill_tokens_while_decoding"],
            async_scheduling=self.async_scheduling,
            waiting_served_ratio=rules["waiting_served_ratio"],
            max_waiting_steps=self.max_waiting_steps,
            hold_while_finishing_steps=rules["hold_while_finishing_steps"],
            min_shared_prefix_to_wait=self.min_shared_prefix_to_wait,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            recurrent_state=recurrent_state,
            num_state_snapshots=num_state_snapshots,
        )

    def prefill_rules(self, step_costs: StepCosts | None, block_size: int) -> dict[str, Any]:
        """The prompt-batching knobs: each as set in the config, else derived from the workers'
        step costs, else the field's default."""
        return {name: value for name, (value, _) in self.prefill_rule_sources(step_costs, block_size).items()}

    def prefill_rule_sources(self, step_costs: StepCosts | None, block_size: int) -> dict[str, tuple[Any, str]]:
        """Each prompt-batching knob's value and where it came from: "config", "step costs" or "default"."""
        derived = {} if step_costs is None else dataclasses.asdict(prefill_rules(step_costs, block_size))
        sources = {}
        for name in PREFILL_RULE_FIELDS:
            if name in self.model_fields_set:
                sources[name] = (getattr(self, name), "config")
            elif name in derived:
                sources[name] = (derived[name], "step costs")
            else:
                sources[name] = (getattr(self, name), "default")
        return sources

    def router_config(self) -> RouterConfig:
        return RouterConfig(
            policy=self.router_policy,
            balance_abs_threshold=self.router_balance_abs_threshold,
            balance_rel_threshold=self.router_balance_rel_threshold,
            min_match_fraction=self.router_min_match_fraction,
            seq_load_tokens=self.router_seq_load_tokens,
            match_in_flight=self.router_match_in_flight,
        )

    def shard_worker_indices(self) -> list[list[int]]:
        """Worker indices of each scheduler shard: contiguous, sizes differing by at most 1."""
        shards, start = [], 0
        for shard in range(self.num_scheduler_shards):
            size = shard_share(self.num_workers, self.num_scheduler_shards, shard)
            shards.append(list(range(start, start + size)))
            start += size
        return shards


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
    scheduler_cpus = args.scheduler_num_cpus * args.num_scheduler_shards
    total_cpus = args.num_workers * worker_cpus + scheduler_cpus + args.max_ingress_replicas * args.ingress_num_cpus
    if total_cpus > cluster_cpus + 1e-9:
        raise ResourceError(
            f"the app needs {total_cpus:g} CPUs ({args.num_workers} workers x {worker_cpus:g} + "
            f"{args.num_scheduler_shards} schedulers x {args.scheduler_num_cpus:g} + "
            f"{args.max_ingress_replicas} ingress replicas x "
            f"{args.ingress_num_cpus:g}) but the cluster has {cluster_cpus:g}; lower num_workers, "
            f"worker_num_cpus or ingress_replicas, or add nodes"
        )
    return ResourcePlan(worker_cpus, worker_gpus, total_cpus, worker_gpus * args.num_workers)


def shard_share(count: int, num_shards: int, shard: int) -> int:
    """Shard `shard`'s share of `count` workers: equal shares, the first shards one more where
    they do not divide (monotone in count, so min <= start <= max holds per shard too)."""
    base, extra = divmod(count, num_shards)
    return base + (shard < extra)


def worker_bundle(plan: ResourcePlan) -> dict[str, float]:
    """The resources of one worker, as a placement group bundle."""
    bundle = {"CPU": plan.worker_num_cpus}
    if plan.worker_num_gpus:
        bundle["GPU"] = float(plan.worker_num_gpus)
    return bundle


def check_placement(args: AppArgs, plan: ResourcePlan, nodes: list[dict[str, float]]) -> None:
    """Checks that the workers can be placed on the cluster's nodes (each node's total
    resources, e.g. from ray.nodes()): a worker never spans nodes, and strict_spread needs
    one node per worker. Raises ResourceError saying what to change."""
    bundle = worker_bundle(plan)
    fits = [min(int(node.get(key, 0.0) / need + 1e-9) for key, need in bundle.items()) for node in nodes]
    num_fitting_nodes = sum(1 for fit in fits if fit >= 1)
    needs = ", ".join(f"{need:g} {key}" for key, need in bundle.items())
    if num_fitting_nodes == 0:
        raise ResourceError(f"no node of the cluster's {len(nodes)} has the {needs} one worker needs")
    if args.worker_placement == "strict_spread" and num_fitting_nodes < args.num_workers:
        raise ResourceError(
            f"worker_placement=strict_spread puts each of the {args.num_workers} workers on its own node, "
            f"but only {num_fitting_nodes} nodes have {needs}; use worker_placement=spread or add nodes"
        )
    if sum(fits) < args.num_workers:
        raise ResourceError(
            f"the nodes hold only {sum(fits)} workers of {needs} each, not {args.num_workers}; "
            "lower num_workers or worker_num_cpus, or add nodes"
        )
