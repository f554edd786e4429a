"""Our paged decoder for the Llama-shaped families (workers/families.py): plain functions over plain tensors.

Not transformers' forward. Per layer:

    x = h + o_proj(paged_attention(rope(q), rope(k), v))      with q, k, v = split(qkv_proj(rms_norm(h)))
    h = x + down_proj(silu(gate) * up)                         with gate, up = split(gate_up_proj(rms_norm(x)))

and what a family changes (ModelConfig's traits): RMSNorms of q and k before RoPE, per head
(Qwen3) or over the whole projection (OLMo 2), layers without RoPE (SmolLM3), partial rotary
(Phi-3), norms on each branch's output instead of its input (OLMo 2) or as well (Gemma),
Gemma's x * (1 + w) norms (the 1 added to the weights at load), a second RoPE base on some
layers (Gemma 3), per-layer sliding windows and attention soft-capping (the attention
backend's), final logit soft-capping (Gemma 2), an embedding
multiplier, a residual multiplier (folded into the o_proj and down_proj weights at load), an
attention scale and a logits scale (Granite), chunked attention (the backend's), q/k norms without
weight after RoPE, and queries scaled by their position on the layers without RoPE (Llama 4).
In some or all layers a mixture of experts takes the dense MLP's place (Mixtral, Qwen3-MoE,
gpt-oss: workers/moe.py's moe_mlp). gpt-oss's attention sinks are the attention backend's too.
DeepSeek V3's layers run multi-head latent attention instead of q/k/v heads, over a pool of one
latent per token (workers/mla.py's mla_attention, torch ops whatever the attention backend).
Some layers keep a state per sequence (workers/recurrent.py's mixers): in attention's place (LFM2,
Granite 4), or beside it (Falcon-H1: attention and a Mamba-2 mixer read the same normed input and
their outputs are summed; the layer's cache is a ParallelCache of its KV and its state pool).

q/k/v and gate/up projections are fused at load (one GEMM each), and on CPU every projection
weight is prepacked for oneDNN (see workers/linear.py), or kept in its GGUF type (a GgufWeight,
workers/gguf_checkpoint.py), as is the embedding then (its rows dequantized per step). Tokens of every sequence
of a step are flattened into one [num_tokens, hidden] batch; attention reads and writes the
paged KV pool through the metadata the runner builds. lm_head runs only on the rows that
sample (compute_logits).

The steps between the GEMMs (residual add + RMSNorm, rotary + KV write, SiLU * up) go
through a LayerOps object (workers/layer_ops.py): fused C kernels on CPU, plain
torch elsewhere. Each layer's residual add is folded into the next RMSNorm:

    residual, x = add_rms_norm(residual, delta, input_norm)     # delta: the last layer's MLP output
    delta = o_proj(attention(...))
    residual, x = add_rms_norm(residual, delta, post_norm)
    delta = down_proj(act_mul(gate_up_proj(x)))            # act: SiLU, or GELU's tanh form (Gemma)

A family with norms after its branches (OLMo 2) has no input_norm or post_norm: the add then
runs alone and the branch reads the residual stream; each branch's output is normed instead
(attn_out_norm, mlp_out_norm) before it is added.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from workers.config import ModelConfig, RopeScaling
from workers.families import FP32_TENSOR_SUFFIXES
from workers.gated_delta import DecodeScratch, GatedDeltaMixer, read_gated_delta_weights
from workers.kda import KdaMixer, read_kda_weights
from workers.gguf_weight import GgufWeight
from workers.kernels import bind_attention
from workers.kernels.cpu_isa import cpu_plan, using_plan
from workers.layer_ops import NativeOps, TorchOps
from workers.linear import LinearWeight, NativeLinear, OneDnnLinear, TorchLinear
from workers.lora import StepLora
from workers.mamba2 import Mamba2Mixer, read_mamba2_weights
from workers.mla import MlaStep, MlaWeights, mla_attention, read_mla_weights
from workers.moe import MoeWeights, moe_mlp, read_moe_weights
from workers.native_forward import NativeForward
from workers.per_layer_inputs import (PerLayerBranch, PerLayerInputWeights, per_layer_branch, per_layer_inputs,
                                      read_per_layer_branch, read_per_layer_input_weights)
from workers.recurrent import StatePool, StateStep, run_mixer
from workers.rope import RotaryEmbedding, deinterleave_rows
from workers.short_conv import read_short_conv

logger = logging.getLogger(__name__)


class WeightError(ValueError):
    """Checkpoint tensors that do not fit the config (missing, unexpected, or misshapen)."""


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged KV pool (shared by every layer)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: pool slot of each token's new k/v
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: keys per sequence after this step (cached + new)
    # some row is a prompt token: a GGUF model's products then take the bf16 tiles where the CPU has
    # them (workers/kernels/cpu_isa.py, gguf_prompt)
    computes_prompt: bool = False
    # each sequence's row in the recurrent layers' state pools (workers/recurrent.py); None: the model has none
    states: StateStep | None = None

    @classmethod
    def one_sequence(cls, num_tokens: int, block_size: int,
                     computes_prompt: bool = False) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and metadata of a step that computes one sequence's first num_tokens tokens
        into blocks 1, 2, ... of the pool (block 0 is the null block): a whole prefill, for tests
        and tools that drive the model without a runner."""
        blocks = torch.arange(1, -(-num_tokens // block_size) + 1, dtype=torch.int32)
        positions = torch.arange(num_tokens)
        return positions, cls(
            slot_mapping=blocks.long()[positions // block_size] * block_size + positions % block_size,
            block_tables=blocks[None, :],
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
            computes_prompt=computes_prompt,
        )


@dataclass(slots=True)
class LayerWeights:
    """Projection weights are in the linear backend's packed form (opaque for oneDNN)."""

    input_norm: torch.Tensor | None  # [hidden]; None: attention reads the residual stream unnormed (OLMo 2)
    qkv: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]; None in an MLA layer
    qkv_bias: torch.Tensor | None  # [(num_heads + 2 * num_kv_heads) * head_dim]
    o: torch.Tensor | None  # [hidden, num_heads * head_dim] (MLA: num_heads * v_head_dim); None in a mixer's layer
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor | None  # [hidden]; None: the MLP reads the residual stream unnormed (OLMo 2)
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a MoE layer (and the three below)
    gate_up_bias: torch.Tensor | None  # [2 * intermediate]
    down: torch.Tensor | None  # [hidden, intermediate]
    down_bias: torch.Tensor | None  # [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]: RMSNorm weight of each query head (Qwen3); None: no weight
    k_norm: torch.Tensor | None = None  # [head_dim]: the same for each key head
    qk_norm_whole: bool = False  # q_norm [heads * head_dim] and k_norm span the whole projection (OLMo 2)
    # the q/k norms apply to the rotated heads (Hunyuan), not before RoPE; with no q_norm, k_norm: without weight
    # (Llama 4's L2 norm)
    qk_norm_after_rope: bool = False
    attn_out_norm: torch.Tensor | None = None  # [hidden]: RMSNorm of the attention's output (OLMo 2)
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: RMSNorm of the MLP's output (OLMo 2)
    use_rope: bool = True  # False: the layer applies no RoPE (SmolLM3)
    local_rope: bool = False  # True: RoPE with the model's local base (Gemma 3's sliding-window layers)
    # attention variants (workers/kernels/__init__.py); None: plain causal attention
    window: int | None = None  # sliding window: a query sees its own key and the window - 1 before it
    attention_chunk: int | None = None  # chunked attention: a query at p sees keys [p // chunk * chunk, p]
    # (floor_scale, attn_scale): each query x (1 + attn_scale * log(1 + floor((p + 1) / floor_scale))) (Llama 4's
    # layers without RoPE); None: none
    query_temperature: tuple[float, float] | None = None
    softcap: float | None = None  # attention scores soft-capped to softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None  # [num_heads]: each head's sink logit in the softmax
    moe: MoeWeights | None = None  # the layer's mixture-of-experts MLP (workers/moe.py); None: the dense MLP above
    mla: MlaWeights | None = None  # multi-head latent attention (workers/mla.py) in place of qkv; None: q/k/v heads
    # [num_heads * head_dim, hidden]: the attention's output x sigmoid(x @ attn_gate.T + attn_gate_bias) before o_proj
    # (Qwen3-Next; q_proj's gate rows, split from its query rows at load); None: no gate
    attn_gate: object | None = None
    attn_gate_bias: torch.Tensor | None = None  # [num_heads * head_dim]
    # a layer that keeps a state per sequence (workers/recurrent.py: a short convolution, a Gated DeltaNet, ...);
    # its products are its own. In attention's place (qkv and o None), or beside it (Falcon-H1: both read the
    # normed input, their outputs summed; the layer's cache a ParallelCache); None: attention alone
    mixer: object | None = None
    head_dim: int = 0  # the layer's q/k/v head width (ModelConfig.layer_head_dim); 0 in an MLA or mixer's layer
    num_kv_heads: int = 0  # its key/value heads (ModelConfig.layer_num_kv_heads)
    # only q is projected (qkv holds q's rows alone): k and v are read from the pool the layer is given, another
    # layer's (Gemma 4's shared K/V), and nothing is written to it
    shares_kv: bool = False
    value_norm: bool = False  # each value head RMS-normalised without weight before it is written (Gemma 4)
    per_layer: PerLayerBranch | None = None  # Gemma 4's per-layer input branch after the MLP (per_layer_inputs.py)
    scalar: torch.Tensor | None = None  # [1]: the layer's output, the whole residual stream, times it (Gemma 4)


# (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim] in torch_ref's layout; an MLA layer's:
# (pool [num_blocks, block_size, 1, rank + rope], its latent part as a view), workers/mla.py; a mixer's layer
# holds its StatePool instead (workers/recurrent.py), a layer with both a ParallelCache
KVCache = tuple[torch.Tensor, ...]


@dataclass(slots=True)
class ParallelCache:
    """The cache of a layer whose mixer runs beside its attention (Falcon-H1): both pools."""

    kv: KVCache  # the attention's paged keys and values
    states: StatePool  # the mixer's state rows (workers/recurrent.py)


class PagedLlamaModel:
    def __init__(self, config: ModelConfig, embed: torch.Tensor | GgufWeight, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: object, rope: RotaryEmbedding,
                 attention: ModuleType, linear: TorchLinear | OneDnnLinear | NativeLinear, ops: TorchOps | NativeOps,
                 local_rope: RotaryEmbedding | None = None, per_layer_inputs: PerLayerInputWeights | None = None):
        self.config = config
        # [vocab, hidden]; a GgufWeight: the GGUF file's blocks, of which a step dequantizes only its tokens' rows
        self.embed = embed
        self._dtype = final_norm.dtype  # the activations' (a GGUF embedding has a type of its own)
        # how the projections are kept: "none" (the dtype), "gguf:<type>", or "<label> (dequantized at load)" (the loader's)
        self.quantization = "none"
        self.layers = layers
        self.final_norm = final_norm  # [hidden]
        self.lm_head = lm_head  # [vocab, hidden] in the linear backend's form (from the embedding when tied)
        self.rope = rope
        self.local_rope = local_rope  # the sliding-window layers' (Gemma 3); None: every layer uses rope
        self.per_layer_inputs = per_layer_inputs  # Gemma 4's per-layer inputs' tensors; None: none
        self.attention = attention  # module with write_kv_cache and paged_attention
        self.linear_backend = linear
        self.linear = linear.linear  # (x, packed weight, bias) -> x @ weight.T + bias
        self.ops = ops
        self.scale = config.traits.attention_scale if config.traits.attention_scale is not None else config.head_dim**-0.5
        # the same layers in one C call, for steps whose every product has a C kernel; None: Python only
        self.native_forward = NativeForward.for_model(self)

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                kv_caches: list[KVCache], lora: StepLora | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final-normed hidden states [num_tokens, hidden].
        lora: the step's LoRA adapters and their rows (workers/lora.py): the C loop adds them where
        our LoRA kernel runs them (CPU), the Python loop elsewhere."""
        with self.products_plan(metadata):
            return self._forward(input_ids, positions, metadata, kv_caches, lora)

    def products_plan(self, metadata: AttentionMetadata) -> contextlib.AbstractContextManager:
        """The kernels a step's products take: a GGUF model's steps that compute prompt tokens
        round x to bf16 for the tiles, not to int8 (workers/kernels/cpu_isa.py, gguf_prompt)."""
        if metadata.computes_prompt and self.quantization.startswith("gguf"):
            return using_plan(cpu_plan().for_prompt_step())
        return contextlib.nullcontext()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                 kv_caches: list[KVCache], lora: StepLora | None = None) -> torch.Tensor:
        native = self.native_forward
        if native is not None and native.takes(input_ids.shape[0]) and (lora is None or lora.use_kernel):
            return native(input_ids, positions, metadata, kv_caches, lora)  # the loop below, in C
        eps, activation = self.config.rms_norm_eps, self.config.activation
        # the metadata, checked once per step (the latent layers': workers/mla.py)
        step = (MlaStep(metadata, self.scale) if self.config.traits.mla is not None
                else bind_attention(self.attention, metadata, self.scale))
        residual, delta = self.embed_tokens(input_ids), None
        inputs = (None if self.per_layer_inputs is None  # Gemma 4: [tokens, layers, size]
                  else per_layer_inputs(self.per_layer_inputs, input_ids, residual, self.linear, eps))
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            residual, x = self.ops.add_rms_norm(residual, delta, layer.input_norm, eps)
            if layer.mixer is None:
                delta = self._attention(layer, x, positions, step, kv_cache, lora, index)
            elif layer.qkv is None:  # a state per sequence in attention's place (workers/recurrent.py)
                delta = run_mixer(layer.mixer, self, x, kv_cache, metadata.states)
            else:  # the mixer beside attention, on the same input (Falcon-H1)
                delta = run_mixer(layer.mixer, self, x, kv_cache.states, metadata.states)
                delta = delta + self._attention(layer, x, positions, step, kv_cache.kv, lora, index)
            if layer.attn_out_norm is not None:
                delta = self.ops.rms_norm(delta, layer.attn_out_norm, eps)
            residual, x = self.ops.add_rms_norm(residual, delta, layer.post_norm, eps)
            if layer.moe is not None:
                delta = moe_mlp(x, layer.moe, self.linear_backend, self.ops, activation)
            else:
                gated = self._gated(x, layer, activation, lora, index)
                delta = self._product(gated, layer.down, layer.down_bias, lora, index, "down")
            if layer.mlp_out_norm is not None:
                delta = self.ops.rms_norm(delta, layer.mlp_out_norm, eps)
            if layer.per_layer is not None or layer.scalar is not None:  # Gemma 4: the layer's output is changed
                residual = self._layer_output(layer, residual, delta, None if inputs is None else inputs[:, index])
                delta = None
        return self.ops.add_rms_norm(residual, delta, self.final_norm, eps)[1]

    def _layer_output(self, layer: LayerWeights, residual: torch.Tensor, delta: torch.Tensor,
                      inputs: torch.Tensor | None) -> torch.Tensor:
        """residual + delta, plus the per-layer input branch, times the layer's scalar (Gemma 4); inputs [T, size]."""
        eps = self.config.rms_norm_eps
        residual = self.ops.add_rms_norm(residual, delta, None, eps)[0]
        if layer.per_layer is not None:
            activation = self.config.activation
            residual = residual + per_layer_branch(layer.per_layer, residual, inputs, self.linear, activation, eps)
        return residual if layer.scalar is None else residual * layer.scalar

    def _product(self, x: torch.Tensor, weight: object, bias: torch.Tensor | None, lora: StepLora | None,
                 index: int, product: str) -> torch.Tensor:
        """x @ weight.T + bias, plus the step's LoRA adapters' part of layer index's product."""
        y = self.linear(x, weight, bias)
        return y if lora is None else lora.add(y, x, index, product)

    def _gated(self, x: torch.Tensor, layer, activation: str, lora: StepLora | None = None,
               index: int = 0) -> torch.Tensor:
        """act(gate) * up of the layer's gate_up product: in one tile product where the products and
        ops are ours and the tiles take it (workers/linear.py, gated_product: the same bits), else
        the product (with its LoRA), then the ops' gated_mul."""
        if self.ops.name == "native" and (lora is None or not lora.adapts(index, "gate_up")):
            fused = self.linear_backend.gated_product(x, layer.gate_up, layer.gate_up_bias, activation)
            if fused is not None:
                return fused
        return self.ops.gated_mul(self._product(x, layer.gate_up, layer.gate_up_bias, lora, index, "gate_up"),
                                  activation)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> the residual stream's start [num_tokens, hidden] (times the family's multiplier)."""
        if isinstance(self.embed, torch.Tensor):
            embedded = F.embedding(input_ids, self.embed)
        else:  # the tokens' rows alone, exactly as the whole table would give
            embedded = self.embed.dequantize_rows(input_ids).to(self._dtype)
        multiplier = self.config.traits.embedding_multiplier
        return embedded if multiplier == 1.0 else embedded * multiplier

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> fp32 logits [num_rows, vocab]; call it on sampling rows only."""
        logits = self.linear_backend.logits(hidden, self.lm_head)
        scale, cap = self.config.traits.logits_scale, self.config.traits.logits_softcap
        if scale != 1.0:
            logits.mul_(scale)
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _attention(self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor, step,
                   kv_cache: KVCache, lora: StepLora | None = None, index: int = 0) -> torch.Tensor:
        """o_proj(attention) of the normed hidden states x; writes this step's k/v into the pool."""
        config = self.config
        if layer.mla is not None:
            attended = mla_attention(self, layer.mla, x, positions, step, kv_cache)
            return self._product(attended, layer.o, layer.o_bias, lora, index, "o")
        qkv = self._product(x, layer.qkv, layer.qkv_bias, lora, index, "qkv")
        head_dim, eps = layer.head_dim, config.rms_norm_eps
        kv_heads = 0 if layer.shares_kv else layer.num_kv_heads  # a layer sharing K/V projects q alone
        if layer.q_norm is not None and not layer.qk_norm_after_rope:
            self.ops.head_rms_norm(qkv, layer.q_norm, layer.q_norm if layer.k_norm is None else layer.k_norm,
                                   config.num_heads, kv_heads, eps, layer.qk_norm_whole)
        if layer.use_rope:
            rope = self.local_rope if layer.local_rope else self.rope
            q, k, v = self.ops.rope(qkv, positions, rope, config.num_heads, kv_heads)
        else:
            q, k, v = self.ops.split_qkv(qkv, config.num_heads, kv_heads, head_dim)
        if layer.qk_norm_after_rope:  # each rotated head [tokens, heads, head_dim] over its head_dim
            q = F.rms_norm(q, (head_dim,), layer.q_norm, eps)
            k = F.rms_norm(k, (head_dim,), layer.k_norm, eps)
        if layer.query_temperature is not None:
            q = _temperature_tuned(q, positions, *layer.query_temperature)
        if layer.value_norm:  # in fp32, as transformers' Gemma 4 norms
            v = F.rms_norm(v.float(), (head_dim,), None, eps).to(v.dtype)
        if not layer.shares_kv:
            step.write(k, v, *kv_cache)
        attended = step.attend(q, *kv_cache, window=layer.window, softcap=layer.softcap, sinks=layer.sinks,
                               attention_chunk=layer.attention_chunk).reshape(x.shape[0], -1)
        if layer.attn_gate is not None:
            attended = attended * torch.sigmoid(self.linear(x, layer.attn_gate, layer.attn_gate_bias))
        return self._product(attended, layer.o, layer.o_bias, lora, index, "o")

    @classmethod
    def from_hf_weights(cls, config: ModelConfig, tensors: Mapping[str, torch.Tensor | GgufWeight],
                        device: str | torch.device, attention: ModuleType, max_positions: int,
                        linear: TorchLinear | OneDnnLinear | NativeLinear | None = None,
                        ops: TorchOps | NativeOps | None = None) -> PagedLlamaModel:
        """Build from Hugging Face tensor names (model.layers.N.self_attn.q_proj.weight, ...).

        Projection weights and the embedding may be GgufWeights (workers/gguf_checkpoint.py): they
        stay quantized, a tied lm_head is the embedding's GgufWeight, and every other tensor
        (norms, biases) is a plain tensor in the model's dtype."""
        linear = linear or TorchLinear()
        tensors = _text_model_tensors(tensors) if config.text_model_of else dict(tensors)
        if config.traits.tensor_names:
            tensors = _renamed(tensors, config.traits.tensor_names)
        weights = _WeightReader(config, tensors, device, linear)
        embed = weights.take("model.embed_tokens.weight", (config.vocab_size, config.hidden_size))
        layers = [weights.layer(index) for index in range(config.num_layers)]
        size = config.traits.per_layer_input_size
        per_layer = (read_per_layer_input_weights(weights, config.num_layers, size, config.hidden_size,
                                                  weights.tensors["model.embed_tokens_per_layer.weight"].shape[0])
                     if size and "model.embed_tokens_per_layer.weight" in weights.tensors else None)
        if size and per_layer is None:
            raise WeightError("missing tensor model.embed_tokens_per_layer.weight")
        final_norm = weights.take_norm("model.", "norm")
        if config.tie_word_embeddings:
            weights.discard("lm_head.weight")
            embed = _for_kernels(embed, logits=True)  # a GGUF table: one packed copy serves the lm_head and the lookups
            lm_head_plain = embed  # native's GEMV reads it in place (no copy); its AVX2 panels are a copy
        else:
            lm_head_plain = _for_kernels(weights.take("lm_head.weight", (config.vocab_size, config.hidden_size)),
                                         logits=True)
        lm_head = linear.pack(lm_head_plain)
        if config.tie_word_embeddings and not isinstance(embed, torch.Tensor):
            embed = lm_head  # the linear's copy (on 2 MB pages) serves the lookups too: one copy of the blocks
        for index in range(config.num_layers, config.num_layers + config.traits.num_extra_layers):
            weights.discard_prefix(f"model.layers.{index}.")  # layers we do not run (GLM-4.5's, DeepSeek's MTP)
        for prefix in config.traits.skipped_prefixes:  # modules we do not run (Qwen3-Next's MTP)
            weights.discard_prefix(prefix)
        weights.check_all_used()
        weights.warn_dequantized()
        rope = RotaryEmbedding(_rope_config(config, local=False), max_positions, final_norm.dtype, device)
        local_rope = None
        if config.traits.local_rope_layers is not None:
            local = dataclasses.replace(_rope_config(config, local=True), rope_theta=config.local_rope_theta,
                                        rope_scaling=RopeScaling("default"))
            local_rope = RotaryEmbedding(local, max_positions, final_norm.dtype, device)
        return cls(config, embed, layers, final_norm, lm_head, rope, attention, linear, ops or TorchOps(), local_rope,
                   per_layer)


def _rope_config(config: ModelConfig, local: bool) -> ModelConfig:
    """The config whose head_dim the global (local: the local) RoPE table rotates: the first such layer's
    (Gemma 4's full-attention layers have a head size of their own)."""
    if config.traits.layer_head_dims is None:
        return config
    locals_ = config.traits.local_rope_layers or (False,) * config.num_layers
    layers = [layer for layer in range(config.num_layers) if locals_[layer] == local]
    return config if not layers else dataclasses.replace(config, head_dim=config.layer_head_dim(layers[0]))


def _temperature_tuned(q: torch.Tensor, positions: torch.Tensor, floor_scale: float, attn_scale: float) -> torch.Tensor:
    """q [tokens, heads, head_dim] x (1 + attn_scale * log(1 + floor((p + 1) / floor_scale))) at each token's
    position p, the factor in fp32 as transformers' Llama 4 computes it."""
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return (q * scales.view(-1, 1, 1)).to(q.dtype)


def _for_kernels(weight: torch.Tensor | LinearWeight, logits: bool = False) -> torch.Tensor | LinearWeight:
    """A checkpoint's weight as our kernels read it fastest (GgufWeight.for_kernels); a plain tensor as it is."""
    return weight if isinstance(weight, torch.Tensor) else weight.for_kernels(logits)


# A multimodal checkpoint's text model under the names of a text-only one (both layouts
# transformers has written), and the tensors that are not the text model's (vision tower,
# projector), which we skip.
_TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                        "language_model.lm_head.": "lm_head."}
_NOT_TEXT_MODEL = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                   "vision_model.", "model.vision_model.",  # Gemma 3's tower, Llama 4's
                   "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")  # Gemma 4's towers and embedders


def _renamed(tensors: dict[str, torch.Tensor], names: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    """The tensors under our names: each (theirs, ours) fragment replaced in every name (FamilyTraits.tensor_names)."""
    renamed = {}
    for name, tensor in tensors.items():
        for theirs, ours in names:
            name = name.replace(theirs, ours)
        renamed[name] = tensor
    return renamed


def _text_model_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for name, tensor in tensors.items():
        if name.startswith(_NOT_TEXT_MODEL):
            continue
        for prefix, replacement in _TEXT_MODEL_PREFIXES.items():
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        renamed[name] = tensor
    return renamed


# Each layer norm's checkpoint name, by where a family puts its norms (FamilyTraits.norms).
# Beware: OLMo 2's post_attention_layernorm norms the attention's output; Llama's of that name
# is the MLP's input norm.
_NORM_NAMES: dict[str, dict[str, str | None]] = {
    "pre": dict(input_norm="input_layernorm", post_norm="post_attention_layernorm", attn_out_norm=None,
                mlp_out_norm=None),
    "post": dict(input_norm=None, post_norm=None, attn_out_norm="post_attention_layernorm",
                 mlp_out_norm="post_feedforward_layernorm"),
    "sandwich": dict(input_norm="input_layernorm", post_norm="pre_feedforward_layernorm",
                     attn_out_norm="post_attention_layernorm", mlp_out_norm="post_feedforward_layernorm"),
}


class _WeightReader:
    """Takes tensors out of a checkpoint dict by name, checking shapes, fusing projections."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], device: str | torch.device,
                 linear: TorchLinear | OneDnnLinear | NativeLinear):
        self.config = config
        self.tensors = tensors
        self.device = device
        self.linear = linear
        # the activations' dtype: the plain tensors' (a GGUF checkpoint's norms are in it too)
        self.dtype = next((t.dtype for name, t in tensors.items() if isinstance(t, torch.Tensor)
                           and t.is_floating_point() and not name.endswith(FP32_TENSOR_SUFFIXES)), torch.float32)
        self.dequantized: list[str] = []  # fused products whose GGUF parts differ in type (dequantized)
        self.decode_scratch = DecodeScratch()  # the Gated DeltaNet and KDA layers' gathered states, one buffer

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | GgufWeight:
        if name not in self.tensors:
            raise WeightError(f"missing tensor {name}")
        tensor = self.tensors.pop(name)
        if tuple(tensor.shape) != shape:
            raise WeightError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        if isinstance(tensor, torch.Tensor):
            return tensor.to(self.device).contiguous()
        # a GGUF weight (CPU kernels only) or a quantized checkpoint's, kernel-ready on its device
        if tensor.device.type != torch.device(self.device).type:
            raise WeightError(f"{name} is a {tensor.label} weight on {tensor.device.type}, but the model is built on "
                              f"{self.device} (GGUF weights: CPU only)")
        return tensor

    def take_fused(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor | LinearWeight:
        """The tensors' rows one after another (q, k, v -> qkv). Quantized parts that can share one
        weight stay quantized (GGUF weights of one type; a quantized checkpoint's of one format,
        groups and input scales: their stacked()); else every part is dequantized to the model's dtype."""
        parts = [self.take(name, shape) for name, shape in zip(names, shapes)]
        quantized = [part for part in parts if not isinstance(part, torch.Tensor)]
        if not quantized:
            return torch.cat(parts, dim=0).contiguous()
        fused = quantized[0].stacked(parts)
        if fused is not None:
            return fused
        self.dequantized.append(" + ".join(
            f"{name.removesuffix('.weight')} ({part.dtype if isinstance(part, torch.Tensor) else part.label})"
            for name, part in zip(names, parts)))
        plain = [p if isinstance(p, torch.Tensor) else p.dequantize().to(self.dtype) for p in parts]
        return torch.cat(plain, dim=0).to(self.device).contiguous()

    def warn_dequantized(self) -> None:
        if self.dequantized:
            logger.warning("%d fused products mix quantized types (GGUF types, or formats, groups or input scales "
                           "that cannot share one weight) and are dequantized to %s (more memory, slower): %s",
                           len(self.dequantized), self.dtype, "; ".join(self.dequantized))

    def discard(self, name: str) -> None:
        self.tensors.pop(name, None)

    def discard_prefix(self, prefix: str) -> None:
        for name in [name for name in self.tensors if name.startswith(prefix)]:
            del self.tensors[name]

    def deinterleave_rope(self, name: str, num_heads: int) -> None:
        """name.weight's and name.bias's rows (where present) reordered in the checkpoint from RoPE's
        interleaved pairs to halves (workers/rope.py, deinterleave_rows)."""
        for tensor_name in (name + ".weight", name + ".bias"):
            tensor = self.tensors.get(tensor_name)
            if tensor is None or tensor.shape[0] != num_heads * self.config.head_dim:
                continue  # absent or misshapen: take() says which
            if not isinstance(tensor, torch.Tensor):
                raise WeightError(f"{tensor_name} is a {tensor.label} weight; interleaved RoPE needs it plain")
            self.tensors[tensor_name] = deinterleave_rows(tensor, num_heads, self.config)

    def split_output_gate(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """name.weight's (and name.bias's, where the family has q biases) rows, each head's query then
        its gate ([heads, 2, head_dim] rows: Qwen3-Next's q_proj), split: the queries stay in the
        checkpoint under name, to be fused with k and v; returns the gates (weight, bias or None)."""
        c = self.config
        rows = c.num_heads * c.head_dim
        parts = []
        for suffix, shape in ((".weight", (2 * rows, c.hidden_size)), (".bias", (2 * rows,))):
            if suffix == ".bias" and not c.traits.qkv_bias:
                parts.append(None)
                continue
            tensor = self.take(name + suffix, shape)
            if not isinstance(tensor, torch.Tensor):
                raise WeightError(f"{name + suffix} is a {tensor.label} weight; its query and gate rows are split "
                                  "at load, which needs it plain")
            per_head = tensor.view(c.num_heads, 2, c.head_dim, *shape[1:])
            self.tensors[name + suffix] = per_head[:, 0].reshape(rows, *shape[1:]).contiguous()
            parts.append(per_head[:, 1].reshape(rows, *shape[1:]).contiguous())
        return parts[0], parts[1]

    def take_residual_branch(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.residual_branch(self.take(name, shape))

    def residual_branch(self, tensor: torch.Tensor) -> torch.Tensor:
        """An o_proj or down_proj tensor times the family's residual multiplier (Granite), so
        that the layer's residual adds need no multiply of their own."""
        multiplier = self.config.traits.residual_multiplier
        if multiplier == 1.0:
            return tensor
        if not isinstance(tensor, torch.Tensor):
            raise WeightError(f"the residual multiplier {multiplier} cannot be folded into a {tensor.label} weight; "
                              "serve it dequantized (a GGUF file: quantization none; a quantized checkpoint: on CPU)")
        return (tensor.float() * multiplier).to(tensor.dtype)

    def scaled(self, name: str, tensor: torch.Tensor | LinearWeight,
               multiplier: float | torch.Tensor) -> torch.Tensor | LinearWeight:
        """Checkpoint tensor name x multiplier (a number, or a tensor that broadcasts: per row), in fp32, back
        in its dtype: a family's constant multiplier folded into a weight (Falcon-H1's). The tensor as it is
        when every multiplier is 1; a quantized one cannot take another."""
        ones = multiplier == 1.0 if isinstance(multiplier, float) else bool((multiplier == 1.0).all())
        if ones:
            return tensor
        if not isinstance(tensor, torch.Tensor):
            raise WeightError(f"{name} is a {tensor.label} weight; the family's multipliers fold into plain weights "
                              "only (serve it dequantized)")
        factor = multiplier.to(tensor.device) if isinstance(multiplier, torch.Tensor) else multiplier
        return (tensor.float() * factor).to(tensor.dtype)

    def pack(self, weight: torch.Tensor | LinearWeight) -> object:
        """A layer's projection in the linear backend's form; a GGUF weight repacked where our int8
        kernel reads it faster that way (GgufWeight.for_kernels)."""
        return self.linear.pack(_for_kernels(weight))

    @staticmethod
    def error(message: str) -> WeightError:
        return WeightError(message)

    def layer(self, index: int) -> LayerWeights:
        c = self.config
        prefix = f"model.layers.{index}."
        attn, mlp = prefix + "self_attn.", prefix + c.traits.mlp_block + "."
        head_dim, kv_heads = c.layer_head_dim(index), c.layer_num_kv_heads(index)
        width = c.layer_intermediate_size(index)
        shares_kv = c.kv_source(index) is not None
        qkv_rows = [c.num_heads * head_dim] + [kv_heads * head_dim] * (0 if shares_kv else 2)
        qkv_names = [attn + "q_proj"] + ([] if shares_kv else [attn + "k_proj", attn + "v_proj"])
        if shares_kv:  # a checkpoint may still hold them (transformers ignores them at load)
            for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias", "k_norm.weight"):
                self.discard(attn + name)
        elif c.traits.k_eq_v_layers is not None and c.traits.k_eq_v_layers[index]:  # v is k's projection
            for suffix in (".weight", ".bias"):
                if attn + "k_proj" + suffix in self.tensors:
                    self.tensors[attn + "v_proj" + suffix] = self.tensors[attn + "k_proj" + suffix]
        gate_up_names = [mlp + "gate_proj", mlp + "up_proj"]
        if c.traits.fused_projections:  # Phi-3: the checkpoint already holds them as we run them
            qkv_rows, qkv_names = [sum(qkv_rows)], [attn + "qkv_proj"]
        if c.traits.fused_projections or mlp + "gate_up_proj.weight" in self.tensors:  # Phi-3, Granite 4
            gate_up_rows, gate_up_names = [2 * width], [mlp + "gate_up_proj"]
        else:
            gate_up_rows = [width] * 2
        norms = _NORM_NAMES[c.traits.norms]
        if c.traits.rope_interleaved:
            self.deinterleave_rope(attn + "q_proj", c.num_heads)
            self.deinterleave_rope(attn + "k_proj", c.num_kv_heads)
        q_norm_width, k_norm_width = ((c.num_heads * head_dim, kv_heads * head_dim)
                                      if c.traits.qk_norm == "projection" else (head_dim, head_dim))
        moe = read_moe_weights(self, index, c.traits.moe, c.hidden_size) if c.is_moe_layer(index) else None
        dense = moe is None
        if not c.has_attention(index):
            return self.mixer_layer(index, moe)
        if c.traits.mla is not None:
            return self.mla_layer(index, moe)
        if c.traits.multipliers is not None:
            self.fold_multipliers(attn, mlp)
        gate, gate_bias = self.split_output_gate(attn + "q_proj") if c.traits.attention_output_gate else (None, None)
        weighted_qk_norm = c.traits.qk_norm in ("head", "projection", "head_after_rope")
        temperature = c.traits.query_temperature if not c.uses_rope(index) else None
        return LayerWeights(
            input_norm=self.take_norm(prefix, norms["input_norm"]),
            qkv=self.pack(self.take_fused([n + ".weight" for n in qkv_names], [(r, c.hidden_size) for r in qkv_rows])),
            qkv_bias=self.take_fused([n + ".bias" for n in qkv_names], [(r,) for r in qkv_rows]) if c.traits.qkv_bias else None,
            o=self.pack(self.take_residual_branch(attn + "o_proj.weight", (c.hidden_size, c.num_heads * head_dim))),
            o_bias=self.take_residual_branch(attn + "o_proj.bias", (c.hidden_size,)) if c.traits.o_bias else None,
            post_norm=self.take_norm(prefix, norms["post_norm"]),
            gate_up=self.pack(
                self.take_fused([n + ".weight" for n in gate_up_names], [(r, c.hidden_size) for r in gate_up_rows])
            ) if dense else None,
            gate_up_bias=(
                self.take_fused([n + ".bias" for n in gate_up_names], [(r,) for r in gate_up_rows])
                if c.mlp_bias and dense else None
            ),
            down=self.pack(
                self.take_residual_branch(mlp + "down_proj.weight", (c.hidden_size, width))
            ) if dense else None,
            down_bias=(
                self.take_residual_branch(mlp + "down_proj.bias", (c.hidden_size,)) if c.mlp_bias and dense else None
            ),
            q_norm=self.take_norm(attn, c.traits.qk_norm_names[0], q_norm_width) if weighted_qk_norm else None,
            k_norm=(self.take_norm(attn, c.traits.qk_norm_names[1], k_norm_width)
                    if weighted_qk_norm and not shares_kv else None),
            qk_norm_whole=c.traits.qk_norm == "projection",
            qk_norm_after_rope=c.traits.qk_norm == "head_after_rope" or (c.traits.qk_norm == "l2_after_rope"
                                                                         and c.uses_rope(index)),
            attn_out_norm=self.take_norm(prefix, norms["attn_out_norm"]),
            mlp_out_norm=self.take_norm(prefix, norms["mlp_out_norm"]),
            use_rope=c.uses_rope(index),
            local_rope=c.uses_local_rope(index),
            window=c.layer_window(index),
            attention_chunk=c.layer_chunk(index),
            query_temperature=temperature,
            softcap=c.traits.attention_softcap,
            sinks=self.take(attn + "sinks", (c.num_heads,)) if c.traits.attention_sinks else None,
            moe=moe,
            head_dim=head_dim,
            num_kv_heads=kv_heads,
            shares_kv=shares_kv,
            value_norm=c.traits.value_norm,
            per_layer=(read_per_layer_branch(self, prefix, c.traits.per_layer_input_size, c.hidden_size)
                       if c.traits.per_layer_input_size else None),
            scalar=self.take(prefix + "layer_scalar", (1,)).to(self.dtype) if c.traits.layer_scalars else None,
            mixer=self.mixer(index) if c.is_recurrent_layer(index) else None,  # beside attention (Falcon-H1)
            attn_gate=None if gate is None else self.pack(gate),
            attn_gate_bias=gate_bias,
        )

    def fold_multipliers(self, attn: str, mlp: str) -> None:
        """The family's product multipliers (ProductMultipliers) multiplied into the layer's checkpoint
        tensors before they are read: q, k, v x attention_in (k's weight and bias x key too), o x
        attention_out, gate x gate, down x down; a bias only by what multiplies the product's output.
        (The separate q/k/v and gate/up tensors: no family with multipliers ships them fused.)"""
        m = self.config.traits.multipliers
        folds = ((attn + "q_proj.weight", m.attention_in), (attn + "k_proj.weight", m.attention_in * m.key),
                 (attn + "k_proj.bias", m.key), (attn + "v_proj.weight", m.attention_in),
                 (attn + "o_proj.weight", m.attention_out), (attn + "o_proj.bias", m.attention_out),
                 (mlp + "gate_proj.weight", m.gate), (mlp + "gate_proj.bias", m.gate),
                 (mlp + "down_proj.weight", m.down), (mlp + "down_proj.bias", m.down))
        for name, multiplier in folds:
            if name in self.tensors:
                self.tensors[name] = self.scaled(name, self.tensors[name], multiplier)

    def mixer_layer(self, index: int, moe: MoeWeights | None) -> LayerWeights:
        """A layer that keeps a state per sequence in attention's place (workers/recurrent.py), with the
        family's norms and MLP around it."""
        c, prefix = self.config, f"model.layers.{index}."
        mlp, mixer = prefix + c.traits.mlp_block + ".", self.mixer(index)
        dense = moe is None
        return LayerWeights(
            input_norm=self.take_norm(prefix, "input_layernorm"),
            qkv=None, qkv_bias=None, o=None, o_bias=None,
            post_norm=self.take_norm(prefix, "post_attention_layernorm"),
            gate_up=self.pack(self.take_gate_up(mlp, c.intermediate_size)) if dense else None,
            gate_up_bias=None,
            down=self.pack(self.take_residual_branch(mlp + "down_proj.weight", (c.hidden_size, c.intermediate_size)))
            if dense else None,
            down_bias=None,
            moe=moe,
            mixer=mixer,
        )

    def mixer(self, index: int) -> object:
        """Layer index's mixer (workers/recurrent.py), of the kind FamilyTraits.mixers names."""
        c, prefix = self.config, f"model.layers.{index}."
        kind = c.traits.mixers[index]
        if kind == "short_conv":
            return read_short_conv(self, prefix + "conv.", c.hidden_size, c.traits.short_conv_width,
                                   c.traits.short_conv_bias)
        if kind == "mamba2":
            weights = read_mamba2_weights(self, prefix + "mamba.", c.traits.mamba2, c.hidden_size)
            return Mamba2Mixer(weights, c.traits.mamba2)
        if kind == "gated_delta":
            weights = read_gated_delta_weights(self, prefix + "linear_attn.", c.traits.gated_delta, c.hidden_size)
            return GatedDeltaMixer(weights, c.traits.gated_delta, c.rms_norm_eps, self.decode_scratch)
        if kind == "kda":
            weights = read_kda_weights(self, prefix + "self_attn.", c.traits.kda, c.hidden_size)
            return KdaMixer(weights, c.traits.kda, c.rms_norm_eps, self.decode_scratch)
        raise WeightError(f"layer {index}: no mixer of kind {kind!r}")

    def take_gate_up(self, mlp: str, width: int) -> torch.Tensor | LinearWeight:
        """A gated MLP's gate rows then up rows [2 * width, hidden]: {mlp}gate_up_proj.weight where the
        checkpoint holds them as one (Granite 4's input_linear, renamed), else gate_proj's and up_proj's."""
        if mlp + "gate_up_proj.weight" in self.tensors:
            return self.take(mlp + "gate_up_proj.weight", (2 * width, self.config.hidden_size))
        hidden = self.config.hidden_size
        return self.take_fused([mlp + "gate_proj.weight", mlp + "up_proj.weight"], [(width, hidden)] * 2)

    def mla_layer(self, index: int, moe: MoeWeights | None) -> LayerWeights:
        """A layer whose attention is MLA (workers/mla.py): Llama's norms and MLP around it."""
        c, prefix = self.config, f"model.layers.{index}."
        attn, mlp, mla = prefix + "self_attn.", prefix + "mlp.", c.traits.mla
        dense = moe is None
        return LayerWeights(
            input_norm=self.take_norm(prefix, "input_layernorm"),
            qkv=None, qkv_bias=None,
            o=self.pack(self.take_residual_branch(attn + "o_proj.weight", (c.hidden_size, c.num_heads * mla.v_head_dim))),
            o_bias=self.take_residual_branch(attn + "o_proj.bias", (c.hidden_size,)) if c.traits.o_bias else None,
            post_norm=self.take_norm(prefix, "post_attention_layernorm"),
            gate_up=self.pack(self.take_fused([mlp + "gate_proj.weight", mlp + "up_proj.weight"],
                                              [(c.intermediate_size, c.hidden_size)] * 2)) if dense else None,
            gate_up_bias=None,
            down=self.pack(self.take_residual_branch(mlp + "down_proj.weight", (c.hidden_size, c.intermediate_size)))
            if dense else None,
            down_bias=None,
            moe=moe,
            mla=read_mla_weights(self, attn, mla, c.num_heads, c.hidden_size, c.traits.qkv_bias),
        )

    def take_norm(self, prefix: str, name: str | None, width: int | None = None) -> torch.Tensor | None:
        """An RMSNorm weight, with the family's offset added (Gemma's x * (1 + w), in fp32 as it
        computes it), so that every norm kernel multiplies by the weight alone."""
        if name is None:
            return None
        weight = self.take(prefix + name + ".weight", (width or self.config.hidden_size,))
        if not isinstance(weight, torch.Tensor):
            raise WeightError(f"the norm {prefix + name} is a {weight.label} weight; norms must be plain")
        offset = self.config.traits.norm_weight_offset
        return weight if offset == 0.0 else (weight.float() + offset).to(weight.dtype)

    def check_all_used(self) -> None:
        leftover = sorted(name for name in self.tensors if "rotary_emb.inv_freq" not in name)
        if leftover:
            shown = ", ".join(leftover[:5]) + (" ..." if len(leftover) > 5 else "")
            raise WeightError(f"{len(leftover)} unexpected tensors: {shown}")
