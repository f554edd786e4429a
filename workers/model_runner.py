"""ModelRunner: executes one SchedulerOutput on our paged model and returns one ModelRunnerOutput.

The runner owns the tensors (weights, the per-layer KV pool, the sampler) and a cache of
per-request state, so a step only carries what changed (see scheduler/outputs.py). It makes
no scheduling decisions: which tokens, which blocks, who is finished all come from the
scheduler. One step:

    drop finished requests -> add new / update cached requests -> copy blocks
    -> flatten the scheduled tokens of every request into one batch -> forward
    -> logits on the last row of each request that caught up -> sample -> append
       (grammar bitmasks of the sampling rows are filled on a thread while the forward runs)

Block 0 of the pool is the scheduler's null block; the runner never writes it unless told to.
"""

from __future__ import annotations

import ctypes
import logging
import time
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from scheduler.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    WorkerStateLostError,
)
from scheduler.sampling_params import SamplingParams
from scheduler.step_costs import StepCosts
from workers.config import ModelConfig
from workers.cuda_graphs import DecodeGraphs
from workers.grammar import GrammarMatchers
from workers.kernels import cpu_attention, resolve_attention_backend_name
from workers.kernels.cpu_isa import cpu_plan
from workers.loader import gguf_source, load_weights, resolve_model_path, serves_gguf
from workers.lora import LoraAdapter, StepLora, load_adapter, lora_kernel_available, lora_triton_kernels
from workers.mla import allocate_latent_cache
from workers.model import AttentionMetadata, KVCache, ParallelCache
from workers.recurrent import StatePool, StateRows
from workers.kernels.sampling import AllowedTokens
from workers.sampler import Sampler, SamplingBatch
from workers.step_costs import measure_step_costs

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def release_freed_heap() -> None:
    """Hands the heap pages freed while loading back to the OS (glibc's malloc_trim; nothing
    elsewhere). Loading copies weights (a GGUF file's blocks read, then repacked), and glibc
    keeps the freed pages of the first copies: the default model served from its GGUF file held
    199 MiB resident after loading, 164 MiB after the trim."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic natively (AVX512_BF16 or AMX): bf16 GEMMs measured
    2-2.3x faster than fp32 on a Zen 4 (AVX512_BF16), and KV reads halve."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own CPUID checks
    try:
        return any(getattr(torch.cpu, probe)() for probe in probes if hasattr(torch.cpu, probe))
    except RuntimeError:
        return False


def resolve_dtype(name: str, device: str | torch.device) -> str:
    """"auto": bfloat16 on GPUs and on CPUs with native bf16 (cpu_has_fast_bf16), float32 elsewhere."""
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected auto or one of {sorted(DTYPES)}")
        return name
    if torch.device(device).type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_kv_cache_dtype(name: str, configured_dtype: str, dtype_name: str, device: torch.device,
                           attention_backend: str, block_size: int) -> str:
    """The KV pool's dtype. "auto" under dtype "auto" on a CPU with our attention kernel is a
    16-bit pool: the activations' bf16, or fp16 under fp32 activations (AVX2 CPUs, a GGUF checkpoint
    served natively), which the kernel widens as it reads (decode attention is bound by reading the
    pool: half its bytes took bench.bench_attention's 30 layers of 16 decodes at 272 keys from 17.5
    to 13.0 ms on a 2-core AVX2 CPU, and one decode from 2.0 to 1.05 ms); llama.cpp's server keeps
    an f16 cache too. Elsewhere "auto" is the activations' dtype: an explicit dtype (float32 is the
    exact path the oracle tests run), a GPU, the torch reference, and blocks of a size the AVX2
    kernel's half loads do not take (it would run its portable body: an explicit float16 there
    says so in the log). An explicit name must be the activations' dtype, or float16 under
    float32 activations on a CPU with the cpu backend."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; expected one of {KV_CACHE_DTYPES}")
    half_fits = (device.type == "cpu" and attention_backend == "cpu"
                 and cpu_attention.pool_dtype_fits(DTYPES[dtype_name], torch.float16))
    fast_blocks = block_size % cpu_attention.HALF_POOL_BLOCK_MULTIPLE == 0
    if name == "auto":
        return "float16" if half_fits and fast_blocks and configured_dtype == "auto" else dtype_name
    if name != dtype_name and not (name == "float16" and half_fits):
        raise ValueError(f"kv_cache_dtype {name} needs activations of that dtype, or float32 activations on a CPU "
                         f"worker with the cpu attention backend (for float16); got dtype {dtype_name} on "
                         f"{device.type} with the {attention_backend} backend. Use kv_cache_dtype: auto.")
    if name == "float16" and dtype_name == "float32" and not fast_blocks:
        logger.warning("kv_cache_dtype float16 with block_size %d: on CPUs without AVX-512 the attention over a "
                       "half pool runs its portable C body, slower than over an fp32 pool; use a block_size "
                       "that is a multiple of %d", block_size, cpu_attention.HALF_POOL_BLOCK_MULTIPLE)
    return name


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    model: str | None = None  # local HF directory, a .gguf file, or None / "default" for SmolLM2-135M-Instruct
    model_cache_dir: str | None = None  # where GGUF checkpoints are converted (None: ~/.cache/rayllm)
    # key of DTYPES, or "auto" (see resolve_dtype): bf16 where the hardware has it. The activations'
    # dtype (the KV pool's: kv_cache_dtype). A GGUF checkpoint served natively (quantization) keeps
    # its projection weights in their GGUF types, and there "auto" means float32 activations on
    # every CPU; an explicit "bfloat16" runs bf16 activations over them, an explicit "float32"
    # serves the GGUF checkpoint dequantized (the exact path the oracle tests run).
    dtype: str = "auto"
    # "auto" (the default): a GGUF checkpoint (the default model, a .gguf path) keeps its quantized
    # weights on CPU unless dtype is "float32" (workers.loader.serves_gguf); "none": its dequantized
    # weights are served (docs/models.md compares them)
    quantization: str = "auto"
    # the KV pool's dtype: "auto" (a 16-bit pool on CPUs under dtype "auto", else the activations'
    # dtype) or one of KV_CACHE_DTYPES (see resolve_kv_cache_dtype)
    kv_cache_dtype: str = "auto"
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks per layer, block 0 included; None: from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30  # KV pool budget over all layers when num_blocks is None
    max_model_len: int | None = None  # None: the model's own limit (see ModelConfig.max_model_len)
    attention_backend: str | None = None  # "cpu" | "torch" | "triton" | None: see workers.kernels.resolve_attention_backend_name
    linear_backend: str | None = None  # "torch" | "onednn" | "native" | None (see workers.linear.select_linear_backend)
    layer_ops: str | None = None  # "torch" | "native" | None (our fused C kernels on CPU, torch otherwise)
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    seed: int = 0  # seed of the generator shared by unseeded requests
    # Decode batch sizes to capture as CUDA graphs (cuda + triton only); () = off; "auto":
    # AUTO_CUDA_GRAPH_SIZES on cuda with the triton backend, off elsewhere (see resolve_graph_sizes).
    cuda_graph_batch_sizes: tuple[int, ...] | str = "auto"
    # time a few steps at start (workers/step_costs.py): the scheduler derives its prompt-batching
    # rules from them (scheduler/step_costs.py); the served app turns it on, tests and tools need not
    measure_step_costs: bool = False
    # LoRA adapters in PEFT's format (workers/lora.py), as (name, directory) pairs: a request
    # names one by lora_name. Each is checked at start (a bad one fails the start) and loaded
    # when a step's lora_loads says so (the scheduler keeps the LRU: scheduler/lora_slots.py)
    lora_adapters: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 64  # an adapter of a higher rank is refused at load
    # models with recurrent layers (workers/recurrent.py): sequences whose states the pool holds at
    # once (the scheduler's max_num_seqs; more are added if forks need them), and the prefix-cache
    # snapshots of states it keeps at block boundaries (0: a prefix hit recomputes the prompt). Both
    # come out of kv_cache_memory_bytes when num_blocks is None.
    max_num_seqs: int = 64
    state_snapshots: int = 64


PER_HEAD_KV = "keys and values per head"  # ModelInfo.kv_cache_kind of every family but the MLA ones


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine needs to know about the worker's model and pool."""

    model_path: str
    eos_token_ids: tuple[int, ...]
    max_model_len: int  # tokens per sequence at most (prompt + output)
    vocab_size: int
    num_blocks: int  # KV blocks per layer, block 0 (null) included
    block_size: int  # tokens per block
    device: str = "cpu"  # torch device type the weights and KV pool live on
    dtype: str = "float32"  # weights and activations dtype
    kv_cache_dtype: str = "float32"  # the KV pool's: dtype, or float16 under float32 (a half pool, CPU)
    attention_backend: str = "torch"  # resolved attention kernels: "cpu" (our C kernel), "torch" (reference) or "triton"
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # decode batch sizes captured as CUDA graphs (none on CPU)
    model_type: str = "llama"  # the checkpoint's family (workers/families.py)
    layer_loop: str = "python"  # "c": our C layer loop for steps its products take; "python": the Python loop
    layer_ops: str = "torch"  # the steps between the products: "native" (our C kernels) or "torch"
    linear_backend: str = "torch"  # the matrix products: "native", "onednn" or "torch"
    # the projection weights: "none" (in dtype), "gguf:<file type>" (e.g. "gguf:Q4_1"), or a quantized
    # checkpoint's label (QuantSpec.label) + " (dequantized at load)", e.g. "awq:4bit-g128 (dequantized at load)"
    quantization: str = "none"
    # what runs each path on this CPU, in words (workers/kernels/cpu_isa.py): "products" (dense
    # weights), "attention", and "gguf" (a GGUF checkpoint's products); {} on a GPU
    isa: dict[str, str] = field(default_factory=dict)
    step_costs: StepCosts | None = None  # measured at start (RunnerConfig.measure_step_costs), else None
    lora: str = ""  # how a step with LoRA adapters runs their products (workers/lora.py), in words
    # what the pool keeps per token and layer, and where its attention runs (an MLA family's: workers/mla.py)
    kv_cache_kind: str = "keys and values per head"  # PER_HEAD_KV
    # recurrent layers (workers/recurrent.py): the prefix-cache snapshots of their states the worker keeps
    # (the scheduler numbers them); has_recurrent_state False: none of its layers is recurrent
    has_recurrent_state: bool = False
    num_state_snapshots: int = 0


@dataclass(slots=True)
class StepTiming:
    """Seconds spent in the phases of the last execute() call."""

    prepare_s: float = 0.0  # state updates, block copies, index tensors (Python side)
    forward_s: float = 0.0  # model forward + lm_head on the sampling rows
    sample_s: float = 0.0  # sampler
    total_s: float = 0.0  # the whole execute()


@dataclass(slots=True)
class RequestState:
    """The worker's copy of one request, kept between steps."""

    request_id: str
    token_ids: list[int]  # prompt + output so far (the runner appends what it samples)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]  # block table
    num_computed_tokens: int  # tokens whose KV is in the pool
    matcher: Any = None  # grammar matcher (workers/grammar.py) of a structured-output request; None: unconstrained
    lora: LoraAdapter | None = None  # the adapter its products add (workers/lora.py); None: the base model
    penalty_history: array | None = None  # int32 copy of token_ids for a request with penalties (the sampler
    #                                       takes it without converting a list every step)


PACKED_STEP_MAX_TOKENS = 64  # CPU steps of at most this many tokens build their index tensors in Python (_packed_batch)


@dataclass(slots=True)
class _StepBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_rows: torch.Tensor  # [num_sampling] int64 rows of the batch whose logits are sampled
    sampling_states: list[RequestState] = field(default_factory=list)  # aligned with logits_rows
    lora: StepLora | None = None  # the step's adapters and their rows; None: the base model's products only


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes one token takes in the pool over all layers: keys and values per head, or an MLA
    layer's latent and RoPE key (ModelConfig.kv_elements_per_token)."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    return sum(config.kv_elements_per_token(layer) for layer in range(config.num_layers)) * element_size


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers."""
    return block_size * kv_bytes_per_token(config, dtype)


def num_blocks_for_memory(config: ModelConfig, block_size: int, memory_bytes: int, dtype: torch.dtype) -> int:
    """How many blocks (the null block 0 included) fit in memory_bytes of KV pool."""
    num_blocks = memory_bytes // kv_bytes_per_block(config, block_size, dtype)
    if num_blocks < 2:
        raise ValueError(f"{memory_bytes} bytes hold {num_blocks} KV blocks; need at least 2 (block 0 is null)")
    return int(num_blocks)


# Decode steps of up to 256 sequences replay a graph on GPU workers by default: on an H200 an
# eager SmolLM2 decode step costs ~9 ms of kernel launches whatever the batch, a replayed one
# 1.9-3.6 ms (docs/gpu.md); capturing these 9 sizes took about 2 s.
AUTO_CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def resolve_graph_sizes(sizes: tuple[int, ...] | str, device: torch.device, attention_backend: str) -> tuple[int, ...]:
    """The decode batch sizes to capture: "auto" means AUTO_CUDA_GRAPH_SIZES where graphs can
    be captured (cuda, triton attention) and none elsewhere; explicit sizes are kept as given
    (DecodeGraphs refuses them where they cannot be captured)."""
    if sizes == "auto":
        return AUTO_CUDA_GRAPH_SIZES if device.type == "cuda" and attention_backend == "triton" else ()
    if isinstance(sizes, str):
        raise ValueError(f'cuda_graph_batch_sizes must be "auto" or a tuple of ints, got {sizes!r}')
    return tuple(sizes)


class ModelRunner:
    def __init__(self, config: RunnerConfig):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        self.model_path = resolve_model_path(config.model, config.model_cache_dir)
        self.model_config = ModelConfig.from_model_dir(self.model_path)
        gguf_path = gguf_source(config.model) if serves_gguf(config.quantization, config.dtype, self.device) else None
        # a native GGUF's "auto" is fp32 activations over the quantized weights, whatever the CPU
        self.dtype_name = ("float32" if gguf_path is not None and config.dtype == "auto"
                           else resolve_dtype(config.dtype, self.device))
        dtype = DTYPES[self.dtype_name]
        model_limit = self.model_config.max_model_len
        self.max_model_len = min(config.max_model_len or model_limit, model_limit)
        c = self.model_config
        self.attention_backend = resolve_attention_backend_name(
            config.attention_backend, self.device, dtype,
            (c.num_heads, c.num_kv_heads, c.max_head_dim), config.block_size)
        if c.traits.mla is not None and self.attention_backend != "torch":
            if config.attention_backend is not None:
                logger.warning("%s: latent attention layers run on the torch reference (workers/mla.py), not on the "
                               "%s attention backend", c.model_type, self.attention_backend)
            self.attention_backend = "torch"
        self.model = load_weights(
            self.model_path, self.model_config, dtype, config.device, self.attention_backend, self.max_model_len,
            config.linear_backend, config.layer_ops, gguf_path=gguf_path,
        )
        if self.device.type == "cpu":
            release_freed_heap()
        self.block_size = config.block_size
        self.kv_cache_dtype_name = resolve_kv_cache_dtype(config.kv_cache_dtype, config.dtype, self.dtype_name,
                                                          self.device, self.attention_backend, config.block_size)
        kv_dtype = DTYPES[self.kv_cache_dtype_name]
        self.states = self._allocate_states()  # None: no recurrent layer
        self._state_grows = 0
        kv_memory = config.kv_cache_memory_bytes - (self.states.num_bytes if self.states is not None else 0)
        if config.num_blocks is None and kv_memory <= 0:
            raise ValueError(f"the recurrent layers' states ({self.states.num_bytes / 2**20:.0f} MiB for "
                             f"{config.max_num_seqs} sequences and {config.state_snapshots} snapshots) take the whole "
                             f"kv_cache_memory_bytes ({config.kv_cache_memory_bytes / 2**20:.0f} MiB): raise it, or "
                             "lower max_num_seqs or state_snapshots")
        self.num_blocks = config.num_blocks or num_blocks_for_memory(
            self.model_config, config.block_size, kv_memory, kv_dtype
        )
        self.kv_caches = self._allocate_kv_caches(kv_dtype)
        self.lora_paths = dict(config.lora_adapters)  # name -> directory, for a request whose step did not load it
        for name, path in config.lora_adapters:  # checked now, loaded when a step needs it
            self._read_adapter(name, path)
        self.lora_adapters: dict[str, LoraAdapter] = {}  # the adapters loaded now, by name
        self.num_lora_loads = 0  # adapters loaded by steps (or for a request whose step did not)
        self.decode_graphs: DecodeGraphs | None = None  # pure-decode steps replay a captured graph
        graph_sizes = resolve_graph_sizes(config.cuda_graph_batch_sizes, self.device, self.attention_backend)
        if self.states is not None:  # a captured step has no StateStep
            graph_sizes = ()
        if graph_sizes:
            max_blocks_per_seq = -(-self.max_model_len // self.block_size)
            try:
                self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, graph_sizes, max_blocks_per_seq,
                                                  capture=True)
            except RuntimeError as error:  # a CUDA failure while capturing
                if config.cuda_graph_batch_sizes != "auto":
                    raise
                logger.warning("capturing CUDA graphs for decode batches %s failed (%s); decode steps run eagerly. "
                               "Set cuda_graph_batch_sizes: [] to skip the capture.", graph_sizes, error)
                torch.cuda.synchronize(self.device)
        self.sampler = Sampler(config.seed, self.device)
        self.grammars = GrammarMatchers(self.model_path, self.model_config.vocab_size,
                                        self.model_config.eos_token_ids, torch.get_num_threads())
        self._mask_thread: ThreadPoolExecutor | None = None  # started by the first step with a grammar
        self.requests: dict[str, RequestState] = {}
        self.last_timing = StepTiming()
        self.step_costs: StepCosts | None = None
        if config.measure_step_costs:
            self.step_costs = measure_step_costs(self)

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_path=str(self.model_path),
            eos_token_ids=self.model_config.eos_token_ids,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            device=self.device.type,
            dtype=self.dtype_name,
            kv_cache_dtype=self.kv_cache_dtype_name,
            attention_backend=self.attention_backend,
            cuda_graph_batch_sizes=self.decode_graphs.batch_sizes if self.decode_graphs is not None else (),
            model_type=self.model_config.text_model_of or self.model_config.model_type,
            layer_loop="c" if self.model.native_forward is not None else "python",
            layer_ops=self.model.ops.name,
            linear_backend=self.model.linear_backend.name,
            quantization=self.model.quantization,
            isa=self._isa(),
            step_costs=self.step_costs,
            lora=self._lora_path(),
            kv_cache_kind=self._kv_cache_kind(),
            has_recurrent_state=self.states is not None,
            num_state_snapshots=self.states.num_snapshots if self.states is not None else 0,
        )

    def _kv_cache_kind(self) -> str:
        """ModelInfo.kv_cache_kind, in words."""
        mla, c = self.model_config.traits.mla, self.model_config
        if self.states is not None:
            kinds = sorted({kind for kind in c.traits.mixers if kind is not None})
            num_recurrent = sum(kind is not None for kind in c.traits.mixers)
            ops = ("in torch ops" if self.model.ops.name == "torch" else "decode steps' convolutions and Mamba-2 and "
                   "Gated DeltaNet updates in C (csrc/recurrent.c), the rest in torch ops")
            if c.traits.mixers_beside_attention:
                return (f"{PER_HEAD_KV} in every layer, and beside them a fixed-size state per sequence in "
                        f"{num_recurrent} of {c.num_layers} ({', '.join(kinds)}: workers/recurrent.py, "
                        f"{self.states.bytes_per_row(self.states.specs)} bytes per sequence, {ops}; "
                        f"{self.states.num_snapshots} prefix-cache snapshots)")
            kv = PER_HEAD_KV if mla is None else f"an MLA latent of {mla.kv_lora_rank} + {mla.qk_rope_head_dim} values"
            return (f"{kv} in {c.num_layers - num_recurrent} of {c.num_layers} layers; a fixed-size state "
                    f"per sequence in the other {num_recurrent} ({', '.join(kinds)}: workers/recurrent.py, "
                    f"{self.states.bytes_per_row(self.states.specs)} bytes per sequence, {ops}; "
                    f"{self.states.num_snapshots} prefix-cache snapshots)")
        if c.traits.kv_sources is not None:  # Gemma 4: the last layers read earlier layers' pools
            readers = [layer for layer in range(c.num_layers) if c.kv_source(layer) is not None]
            pairs = ", ".join(f"{layer} <- {c.kv_source(layer)}" for layer in readers)
            return (f"{PER_HEAD_KV} in {c.num_layers - len(readers)} of {c.num_layers} layers; the other "
                    f"{len(readers)} read an earlier layer's ({pairs})")
        if mla is None:
            return PER_HEAD_KV
        return (f"MLA latent: {mla.kv_lora_rank} + {mla.qk_rope_head_dim} values per token and layer; its attention "
                "runs on the torch path (prompts expanded, decodes absorbed), not on our C loop or kernels")

    def _lora_path(self) -> str:
        """ModelInfo.lora: where a step's adapter products run, and what such a step gives up."""
        graphs = ", eager (no CUDA graphs)" if self.decode_graphs is not None else ""
        if lora_triton_kernels(self.device) is not None:  # CUDA: as StepLora.of_rows chooses
            return "triton shrink and expand kernels, one launch each per product" + graphs
        if self.device.type == "cpu" and lora_kernel_available():
            kernel = "our C kernel, " + ("fp32" if self._lora_kernel_dtype() == torch.float32 else "bf16") + " weights"
            return kernel + (", in the C layer loop" if self.model.native_forward is not None else "")
        return "torch products" + graphs + (" (our C kernels did not build)" if self.device.type == "cpu" else "")

    def _isa(self) -> dict[str, str]:
        """ModelInfo.isa: the plan's words where the path runs our C kernels, else the backend's name."""
        if self.device.type != "cpu":
            return {}
        isa = cpu_plan().isa(self.model.dtype, self.model.quantization.startswith("gguf"))
        if self.model.linear_backend.name != "native":
            isa["products"] = self.model.linear_backend.name
        if self.attention_backend != "cpu":
            isa["attention"] = self.attention_backend
        return isa

    def _allocate_kv_caches(self, dtype: torch.dtype) -> list[KVCache]:
        """One pool per layer in the attention backend's layout. Zeroed: masked-out slots may
        still be multiplied by 0 in attention, and 0 * NaN is NaN."""
        c = self.model_config

        def pool(layer: int) -> KVCache:
            if c.traits.mla is not None:  # one latent and one RoPE key per token (workers/mla.py)
                return allocate_latent_cache(self.num_blocks, self.block_size, c.traits.mla, dtype, self.device)
            return self.model.attention.allocate_kv_cache(self.num_blocks, self.block_size, c.layer_num_kv_heads(layer),
                                                          c.layer_head_dim(layer), dtype, self.device)

        kv: list[KVCache | None] = []
        for layer in range(c.num_layers):  # a layer sharing K/V (Gemma 4) holds its source's pool: the same tensors
            source = c.kv_source(layer)
            kv.append(kv[source] if source is not None else pool(layer) if c.has_attention(layer) else None)
        # recurrent layers hold their state pools instead (Kimi Linear's KDA between MLA layers), or beside their KV
        return kv if self.states is None else self._with_states(kv)

    def _allocate_states(self) -> StateRows | None:
        """The recurrent layers' state pools (workers/recurrent.py); None when the model has none."""
        c = self.model_config
        if not c.has_recurrent_layers:
            return None
        specs = [layer.mixer.state_specs() if layer.mixer is not None else None for layer in self.model.layers]
        return StateRows(specs, self.config.max_num_seqs, self.config.state_snapshots, self.device)

    def _with_states(self, kv: list[KVCache | None]) -> list[KVCache | StatePool | ParallelCache]:
        """Each layer's cache from its paged KV (None: it has none) and the state pools as they are now: the
        KV alone, the layer's StatePool alone, or a ParallelCache of both (a mixer beside attention)."""
        caches = []
        for layer, pool in enumerate(kv):
            states = self.states.pools[layer]
            caches.append(pool if states is None else states if pool is None else ParallelCache(pool, states))
        return caches

    def _kv_pools(self) -> list[KVCache | None]:
        """Each layer's paged KV (a ParallelCache's kv); None for a recurrent layer in attention's place."""
        c = self.model_config
        return [cache.kv if isinstance(cache, ParallelCache) else cache if c.has_attention(layer) else None
                for layer, cache in enumerate(self.kv_caches)]

    @property
    def _attention_pools(self) -> list[KVCache]:
        """The layers' pools that are paged KV (not recurrent states), each once (a layer sharing K/V has none)."""
        c = self.model_config
        return [pool for layer, pool in enumerate(self._kv_pools()) if pool is not None and c.kv_source(layer) is None]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        started = time.perf_counter()
        self._update_states(scheduler_output)
        if self.states is not None and self.states.num_grows != self._state_grows:  # forks outgrew the pools
            self._state_grows = self.states.num_grows
            self.kv_caches = self._with_states(self._kv_pools())
        if scheduler_output.copy_blocks:
            self._copy_blocks(scheduler_output.copy_blocks)
        if scheduler_output.is_empty:
            self.last_timing = StepTiming(total_s=time.perf_counter() - started)
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self._prepare_batch(scheduler_output)
        masks = self._start_grammar_masks(batch.sampling_states)  # filled while the forward runs
        prepared = time.perf_counter()
        graph_size = None  # captured batch size this step is padded to; None: eager
        if self.decode_graphs is not None and batch.lora is None:
            graph_size = self.decode_graphs.padded_size(batch.input_ids.shape[0], batch.metadata.seq_lens.shape[0])
        with torch.inference_mode():
            if graph_size is not None:
                logits = self.decode_graphs.run(batch.input_ids, batch.positions, batch.metadata, graph_size)
                logits = logits[batch.logits_rows] if batch.sampling_states else None
            else:
                hidden = self.model.forward(batch.input_ids, batch.positions, batch.metadata, self.kv_caches,
                                            batch.lora)
                logits = self.model.compute_logits(hidden[batch.logits_rows]) if batch.sampling_states else None
        forwarded = time.perf_counter()
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_scheduled
        output = self._sample(logits, batch.sampling_states, masks) if logits is not None else ModelRunnerOutput({})
        finished = time.perf_counter()
        self.last_timing = StepTiming(prepared - started, forwarded - prepared, finished - forwarded, finished - started)
        return output

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        if self.states is not None:  # before the finished: a forked parent is among them
            for parent, child in scheduler_output.state_forks:
                self.states.fork(parent, child)
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
            if self.states is not None:
                self.states.release(request_id)
        for name in scheduler_output.lora_unloads:  # first: a name may come back from another directory
            self.lora_adapters.pop(name, None)
        for name, path in scheduler_output.lora_loads.items():
            self.load_lora(name, path)
        for new in scheduler_output.new_requests:
            self.requests[new.request_id] = self._new_state(new)
            if self.states is not None:
                self.states.start(new.request_id, new.num_computed_tokens, new.state_snapshot)
        for cached in scheduler_output.cached_requests:
            self._update_cached(cached)

    def _new_state(self, new: NewRequestData) -> RequestState:
        grammar = new.sampling_params.grammar  # a resumed request replays its output through a new matcher
        token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
        return RequestState(
            request_id=new.request_id,
            token_ids=token_ids,
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            matcher=None if grammar is None else self.grammars.new_matcher(grammar, new.output_token_ids),
            penalty_history=array("i", token_ids) if new.sampling_params.has_penalties else None,
            lora=self._adapter(new),
        )

    def _adapter(self, new: NewRequestData) -> LoraAdapter | None:
        if new.lora_name is None:
            return None
        adapter = self.lora_adapters.get(new.lora_name)
        if adapter is not None:
            return adapter
        path = new.lora_path or self.lora_paths.get(new.lora_name)  # no step loaded it: a driver without a scheduler
        if path is None:
            raise ValueError(f"request {new.request_id!r} names LoRA adapter {new.lora_name!r}, which this worker "
                             f"has not loaded (it has: {sorted(self.lora_adapters)})")
        return self.load_lora(new.lora_name, path)

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Loads the adapter at path as name (replacing one of that name); raises LoraError."""
        adapter = self._read_adapter(name, path)
        if lora_triton_kernels(self.device) is not None:
            adapter.stacks()  # the Triton kernels' copy, now rather than in a step (freed with the adapter)
        self.lora_adapters[name] = adapter
        self.num_lora_loads += 1
        return adapter

    def check_lora(self, name: str, path: str) -> dict[str, int]:
        """Loads the adapter to check that it fits this model, and drops it: {"rank", "num_bytes"}.
        Raises LoraError with the reason."""
        adapter = self._read_adapter(name, path)
        return {"rank": adapter.rank, "num_bytes": adapter.num_bytes}

    def _read_adapter(self, name: str, path: str) -> LoraAdapter:
        """The adapter in the activations' dtype, and our LoRA kernel's copy in _lora_kernel_dtype."""
        return load_adapter(name, path, self.model_config, DTYPES[self.dtype_name], self.device,
                            self.config.max_lora_rank, self._lora_kernel_dtype())

    def _lora_kernel_dtype(self) -> torch.dtype:
        """fp32 beside the exact fp32 model, else bf16 (half the bytes a step reads; the base is bf16 or
        quantized there)."""
        exact = self.dtype_name == "float32" and self.model.quantization == "none"
        return torch.float32 if exact else torch.bfloat16

    def reset(self) -> None:
        """Forgets every request (their KV blocks are the scheduler's to reuse) and every loaded
        adapter (a new scheduler starts with none loaded)."""
        for request_id in list(self.states.row_of) if self.states is not None else ():
            self.states.release(request_id)
        self.requests.clear()
        self.lora_adapters.clear()

    def _update_cached(self, cached: CachedRequestData) -> None:
        state = self.requests.get(cached.request_id)
        if state is None:
            raise WorkerStateLostError(
                f"cached request {cached.request_id!r} is unknown to this worker (never sent, or dropped)")
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens

    def _copy_blocks(self, copy_blocks: list[tuple[int, int]]) -> None:
        sources = torch.tensor([src for src, _ in copy_blocks], device=self.device)
        destinations = torch.tensor([dst for _, dst in copy_blocks], device=self.device)
        for k_cache, v_cache in self._attention_pools:
            k_cache.index_copy_(0, destinations, k_cache.index_select(0, sources))
            v_cache.index_copy_(0, destinations, v_cache.index_select(0, sources))

    def _prepare_batch(self, scheduler_output: SchedulerOutput) -> _StepBatch:
        """Flatten every scheduled token into one batch; index tensors come from flat lists."""
        input_ids: list[int] = []
        positions: list[int] = []
        block_rows: list[list[int]] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        token_seqs: list[int] = []  # per token: index of its sequence in the batch
        logits_rows: list[int] = []
        sampling_states: list[RequestState] = []
        computes_prompt = False
        row_adapters: list[tuple[LoraAdapter | None, int, int]] = []  # per request: (adapter, first row, end row)
        starts: list[int] = []
        for request_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self.requests.get(request_id)
            if state is None:
                raise WorkerStateLostError(f"scheduled request {request_id!r} is unknown to this worker")
            start = state.num_computed_tokens
            end = start + num_scheduled
            self._check_request(state, end)
            starts.append(start)
            computes_prompt = computes_prompt or start < state.num_prompt_tokens
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            token_seqs.extend([len(block_rows)] * num_scheduled)
            block_rows.append(state.block_ids)
            query_start_loc.append(query_start_loc[-1] + num_scheduled)
            row_adapters.append((state.lora, query_start_loc[-2], query_start_loc[-1]))
            seq_lens.append(end)
            if end == len(state.token_ids):  # caught up: sample from the last row
                logits_rows.append(query_start_loc[-1] - 1)
                sampling_states.append(state)
        width = max(len(row) for row in block_rows)
        lora = StepLora.of_rows(row_adapters, self.device) if self.lora_adapters else None
        states = None
        if self.states is not None:
            scheduled = scheduler_output.num_scheduled_tokens
            states = self.states.step(list(scheduled), starts, list(scheduled.values()), query_start_loc,
                                      scheduler_output.state_saves)
        if self.device.type == "cpu" and len(positions) <= PACKED_STEP_MAX_TOKENS:
            batch = self._packed_batch(input_ids, positions, block_rows, width, query_start_loc, seq_lens, logits_rows,
                                       sampling_states, computes_prompt)
            batch.lora = lora
            batch.metadata.states = states
            return batch
        block_tables = torch.tensor([row + [0] * (width - len(row)) for row in block_rows], dtype=torch.int32)
        positions_tensor = torch.tensor(positions, dtype=torch.long)
        slot_mapping = (
            block_tables[torch.tensor(token_seqs), positions_tensor // self.block_size].long() * self.block_size
            + positions_tensor % self.block_size
        )
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            computes_prompt=computes_prompt,
            states=states,
        )
        return _StepBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=positions_tensor.to(device),
            metadata=metadata,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
            sampling_states=sampling_states,
            lora=lora,
        )

    def _packed_batch(self, input_ids: list[int], positions: list[int], block_rows: list[list[int]], width: int,
                      query_start_loc: list[int], seq_lens: list[int], logits_rows: list[int],
                      sampling_states: list[RequestState], computes_prompt: bool) -> _StepBatch:
        """_prepare_batch's tensors for a small CPU step (decodes): the slots computed here, and every
        index tensor a view of one of two buffers, so a step builds 2 tensors instead of about 15.
        Between two decode steps the 100 MB of weights a step streams have evicted the interpreter's
        and torch's own code and data, so each torch call costs several times what it does in a loop."""
        size = self.block_size
        slots = []
        start = 0
        for row, end in zip(block_rows, query_start_loc[1:]):
            slots.extend(row[position // size] * size + position % size for position in positions[start:end])
            start = end
        n, s = len(input_ids), len(block_rows)
        longs = torch.tensor(input_ids + positions + slots + logits_rows, dtype=torch.long)
        ints = torch.tensor([i for row in block_rows for i in (row + [0] * (width - len(row)))] + query_start_loc
                            + seq_lens, dtype=torch.int32)
        metadata = AttentionMetadata(
            slot_mapping=longs[2 * n:3 * n],
            block_tables=ints[:s * width].view(s, width),
            query_start_loc=ints[s * width:s * width + s + 1],
            seq_lens=ints[s * width + s + 1:],
            computes_prompt=computes_prompt,
        )
        return _StepBatch(input_ids=longs[:n], positions=longs[n:2 * n], metadata=metadata, logits_rows=longs[3 * n:],
                          sampling_states=sampling_states)

    def _check_request(self, state: RequestState, end: int) -> None:
        if end > len(state.token_ids):
            raise ValueError(
                f"request {state.request_id}: scheduled up to token {end}, the worker knows {len(state.token_ids)}"
            )
        if end > self.max_model_len:
            raise ValueError(f"request {state.request_id}: {end} tokens exceed max_model_len {self.max_model_len}")
        if -(-end // self.block_size) > len(state.block_ids):
            raise ValueError(
                f"request {state.request_id}: {end} tokens need {-(-end // self.block_size)} blocks, "
                f"its table has {len(state.block_ids)}"
            )

    def _start_grammar_masks(self, states: list[RequestState]) -> Future[AllowedTokens] | None:
        """The bitmask of this step's rows under a grammar, filled on a thread of its own so it
        overlaps the forward (llguidance releases the GIL): their matchers already hold the
        last step's tokens. None when no sampling row has a grammar."""
        constrained = [row for row, state in enumerate(states) if state.matcher is not None]
        if not constrained:
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        matchers = [states[row].matcher for row in constrained]
        return self._mask_thread.submit(self.grammars.allowed_tokens, constrained, matchers, self.device)

    def _sample(self, logits: torch.Tensor, states: list[RequestState],
                masks: Future[AllowedTokens] | None) -> ModelRunnerOutput:
        batch = SamplingBatch(
            params=[state.sampling_params for state in states],
            output_positions=[len(state.token_ids) - state.num_prompt_tokens for state in states],
            token_ids=[state.token_ids if state.penalty_history is None else state.penalty_history for state in states],
            num_prompt_tokens=[state.num_prompt_tokens for state in states],
            allowed_tokens=masks.result() if masks is not None else None,
        )
        result = self.sampler.sample(logits, batch)
        sampled: dict[str, int] = {}
        logprobs = {}
        for state, token_id, token_logprobs in zip(states, result.token_ids, result.logprobs):
            state.token_ids.append(token_id)
            if state.penalty_history is not None:
                state.penalty_history.append(token_id)
            if state.matcher is not None:
                self.grammars.accept(state.matcher, token_id)
            sampled[state.request_id] = token_id
            if token_logprobs is not None:
                logprobs[state.request_id] = token_logprobs
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs)
