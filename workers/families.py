"""The model families we load, each as what it changes in the one decoder layer we run.

Every family is a Llama-shaped decoder (embedding, layers of attention then a gated-SiLU MLP,
pre-norms with RMSNorm, a final norm, an lm_head). A family is a function from its
config.json (a dict) to FamilyTraits: the handful of switches and numbers by which it differs.
ModelConfig.from_dict reads them; the torch layer loop (workers/model.py), our C layer loop
(workers/kernels/csrc/forward.c) and the GPU path all act on the same traits.

    model_type  what differs from llama
    llama       q, k, v and o biases when `attention_bias`
    mistral     no biases; `sliding_window` caps the context we serve
    qwen2       q, k, v biases always, o never; a sliding window is refused
    qwen3       an RMSNorm over each head's query and key before RoPE (q_norm, k_norm); biases
                when `attention_bias`
    smollm3     some layers have no RoPE (`no_rope_layers`: 1 keeps RoPE, 0 drops it)
    granite     multipliers: embeddings x embedding_multiplier, each residual branch x
                residual_multiplier, attention scores x attention_multiplier (the scale),
                logits / logits_scaling
    olmo2       norms after each branch instead of before it (post_attention_layernorm on the
                attention's output, post_feedforward_layernorm on the MLP's), and RMSNorms over
                the whole query and key projections before RoPE
    gemma2      norms before and after each branch ("sandwich"), each x * (1 + w); GELU (tanh)
                MLPs; embeddings x sqrt(hidden); scores x query_pre_attn_scalar ** -0.5;
                sliding-window layers (layer_types); attention and final logits soft-capped
    gemma3_text as gemma2, plus per-head q/k norms, no soft-capping by default, and a second
                RoPE base (rope_local_base_freq) on the sliding-window layers
    gemma4_text as gemma3_text, but norms x w (no offset), a weightless RMSNorm of each value head, scores x 1,
                each layer's output x its layer_scalar; per-layer inputs (a second embedding table plus a
                projection of the embeddings, gated into each layer after its MLP); the last
                num_kv_shared_layers layers read the K/V pool of the last earlier layer of their type; full-
                attention layers with their own head size and "proportional" RoPE; attention_k_eq_v (v is k's
                projection) and use_double_wide_mlp; enable_moe_block is refused
    olmo3       as olmo2, plus sliding-window layers (layer_types; by default three of every four)
                whose RoPE is rope_parameters' sliding_attention entry (the full-attention layers'
                may be scaled)
    exaone4     norms after each branch (as olmo2), per-head q/k norms (as qwen3), sliding-window
                layers per layer_types (by default three of every sliding_window_pattern) with
                RoPE, and full-attention layers without it (none when sliding_window is null)
    seed_oss    llama's layer with q, k and v biases (`attention_bias`, on by default), an o bias
                only with `attention_out_bias`, and MLP biases with `mlp_bias`
    phi3        q, k and v in one checkpoint tensor (qkv_proj), gate and up in another
                (gate_up_proj); partial rotary (partial_rotary_factor) and longrope scaling are
                read by workers/config.py for every family; `sliding_window` caps the context
    mixtral     mistral's attention; every MLP is a mixture of experts (MoeTraits, workers/moe.py):
                softmax over the router's logits, the top k, renormalised
    qwen3_moe   qwen3's attention; MoE MLPs (softmax, top k, renormalised iff `norm_topk_prob`)
                in every `decoder_sparse_step`-th layer except `mlp_only_layers`, which keep a
                dense MLP of `intermediate_size`
    qwen2_moe   qwen2's attention (q, k, v biases iff `qkv_bias`); qwen3_moe's MoE layers, each
                with a shared expert beside the routed ones: a dense MLP of
                `shared_expert_intermediate_size` on every token, its output scaled by
                sigmoid(x . shared_expert_gate) and added
    glm4_moe    q, k, v biases iff `attention_bias`; per-head q/k norms iff `use_qk_norm`; half of
                each head rotated (workers/config.py); dense MLPs in the first `first_k_dense_replace`
                layers, MoE MLPs after them: sigmoid scores, a correction bias on the choice only
                (e_score_correction_bias), group-limited top k (n_group, topk_group), the unbiased
                weights renormalised iff `norm_topk_prob` and x routed_scaling_factor; a shared
                expert (n_shared_experts of moe_intermediate_size, ungated) on every token; its
                multi-token-prediction layer (model.layers.{num_hidden_layers}) is skipped
    minimax_m2  q and k RMSNorms over the whole projections (as olmo2); `rotary_dim` of each head
                rotated; every MLP MoE (block_sparse_moe, w1/w3/w2): sigmoid scores plus a
                correction bias choose the top k, the unbiased weights renormalised
    ernie4_5_moe llama's attention with RoPE over interleaved pairs (FamilyTraits.rope_interleaved);
                MoE MLPs in every moe_layer_interval-th layer from moe_layer_start_index to
                moe_layer_end_index, dense ones elsewhere: softmax scores plus a correction bias
                (moe_statics.e_score_correction_bias, [1, E]) choose the top moe_k, the unbiased
                weights renormalised; moe_num_shared_experts shared experts on every token
    hunyuan_v1_moe  per-head q/k norms after RoPE (query_layernorm, key_layernorm); RoPE "dynamic"
                with an `alpha` is a fixed larger base (workers/config.py); every MLP a MoE
                (softmax, top moe_topk, renormalised; router mlp.gate.wg) of experts of
                intermediate_size, plus a shared MLP of that width (shared_mlp) on every token
    gpt_oss     q, k, v and o biases; a learned sink logit per head in every attention softmax
                (self_attn.sinks); sliding-window layers (layer_types, by default every other one);
                yarn RoPE; MoE MLPs in every layer whose router (mlp.router, with a bias) takes the
                top k logits, then a softmax over those k; experts with biases, stored [E, in, out]
                with gate and up interleaved (or MXFP4 blocks and scales, dequantized at load), and a
                clamped SwiGLU (swiglu_limit, swiglu_alpha)
    llama4_text RoPE over interleaved pairs (FamilyTraits.rope_interleaved) on all but every
                no_rope_layer_interval-th layer (no_rope_layers: 1 keeps RoPE), and on those layers
                chunked attention (attention_chunk_size; layer_types) and an RMSNorm without weight of
                each rotated q and k head (use_qk_norm); the layers without RoPE attend to every key,
                each query x (1 + attn_scale * log(1 + floor((p + 1) / floor_scale))) at position p
                (attn_temperature_tuning); MoE MLPs (feed_forward) in every interleave_moe_layer_step-th
                layer (or moe_layers): the top k router logits, their sigmoids (not renormalised)
                multiplying each chosen expert's input, not its output; experts [E, in, out] with gate
                and up in halves; a shared expert of intermediate_size on every token; dense MLPs of
                intermediate_size_mlp elsewhere
    deepseek_v3 multi-head latent attention in every layer (MlaTraits, workers/mla.py): q through a
                low-rank pair (q_a_proj, q_a_layernorm, q_b_proj) or q_proj; one latent and one
                shared RoPE key per token (kv_a_proj_with_mqa, kv_a_layernorm), expanded per head by
                kv_b_proj; DeepSeek's interleaved RoPE; yarn's mscale_all_dim squared in the scale;
                glm4_moe's MoE layers after the first first_k_dense_replace (its defaults differ)
    lfm2        short-convolution layers between full-attention ones (layer_types): each keeps the last
                conv_L_cache - 1 inputs of its sequence, not keys and values (workers/short_conv.py);
                per-head q/k norms (q_layernorm, k_layernorm); the MLP's w1, w3, w2, of a width
                derived from block_ff_dim; its names (operator_norm, ffn_norm, embedding_norm) read as
                ours at load (FamilyTraits.tensor_names)
    granitemoehybrid  Granite 4: Mamba-2 layers (workers/mamba2.py: a conv window and an SSM state per
                sequence) between attention layers (layer_types "mamba" / "attention"); granite's
                multipliers; RoPE only with position_embedding_type "rope" (Granite 4.0-H: none); the
                MLP is shared_mlp (input_linear: gate and up in one tensor), plus a MoE of
                num_local_experts when there are any (top k logits, softmax over those k), the
                shared_mlp then its shared expert
    qwen3_next  Gated DeltaNet layers (linear_attention, workers/gated_delta.py) between full-attention
                ones (layer_types, or every full_attention_interval-th full): each keeps a causal
                convolution's last inputs and a [head_k_dim, head_v_dim] matrix per value head, not keys
                and values; on the full-attention layers q_proj gives each head's query and an output
                gate (attention x sigmoid(gate) before o_proj), per-head q/k norms, a quarter of each
                head rotated by default; every norm x (1 + w) but the Gated DeltaNet's own; qwen2_moe's
                MoE layers (gated shared expert), renormalised by default; the mtp.* module is skipped
    qwen3_5_text  Qwen3.5: qwen3_next's layers, but the Gated DeltaNet's input products are four plain
                tensors (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: GatedDeltaTraits.projections), not
                grouped by key head; a dense MLP in every layer; RoPE's mrope_section is moot for text (its
                three position axes are the token's position); the checkpoints are published multimodal
                (qwen3_5: the vision tower, model.visual.*, and mtp.* are skipped)
    qwen3_5_moe_text  as qwen3_5_text with a MoE in every layer: softmax, top k, always renormalised, a gated
                shared expert (no decoder_sparse_step, mlp_only_layers or norm_topk_prob; no intermediate_size)
    falcon_h1   in every layer attention and a Mamba-2 mixer side by side on the same normed input, their
                outputs summed (FamilyTraits.mixers_beside_attention: a layer keeps keys and values and a
                state); µP multipliers (embedding, lm_head, attention in / key / out, ssm in / parts / out,
                MLP gate / down), all but the first two folded into the weights at load; the mixer's
                gated RMSNorm only with mamba_rms_norm, before or after the gate (mamba_norm_before_gate);
                out_proj's bias with projectors_bias; feed_forward, pre_ff_layernorm, final_layernorm
    kimi_linear Kimi Delta Attention layers (linear_attention, workers/kda.py: the Gated DeltaNet with a
                decay per key channel, a sigmoid output gate) between deepseek_v3's MLA layers without RoPE
                (full_attention; layer_types or linear_attn_config's 1-based kda_layers / full_attn_layers);
                deepseek_v3's MoE on mlp_layer_types' "sparse" layers, under Moonshot's key names
                (num_experts, num_experts_per_token, num_expert_group, moe_renormalize, num_shared_experts)

transformers' modelling files are the reference for each (tests build tiny random
checkpoints with transformers' own classes and compare greedy tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace


class FamilyError(ValueError):
    """A config.json of a known family with a setting we do not serve."""


@dataclass(frozen=True, slots=True)
class FamilyTraits:
    qkv_bias: bool  # q, k and v projections carry a bias
    o_bias: bool  # the output projection carries a bias
    sliding_window: int | None = None  # one window for every layer (caps the served context); None: full
    qk_norm: str | None = None  # RMSNorm of q and k before RoPE: "head" (each head, weights [head_dim]) or
    #                             "projection" (the whole q and the whole k, weights [heads * head_dim]);
    #                             or after RoPE: "head_after_rope" (each rotated head: Hunyuan), or
    #                             "l2_after_rope" (each rotated head, no weight, on the layers with RoPE
    #                             only: Llama 4's L2 norm, x / sqrt(mean(x^2) + eps))
    qk_norm_names: tuple[str, str] = ("q_norm", "k_norm")  # their tensors: self_attn.{name}.weight
    norms: str = "pre"  # "pre": RMSNorm before each branch; "post": on each branch's output instead (OLMo 2)
    fused_projections: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    norm_weight_offset: float = 0.0  # every RMSNorm multiplies by (offset + w): Gemma's 1
    layer_windows: tuple[int | None, ...] | None = None  # per layer: its sliding window, None: full; None: all full
    # per layer: its attention chunk C (the query at p sees keys [p // C * C, p]: Llama 4's RoPE layers), None:
    # none; None: no layer is chunked
    layer_chunks: tuple[int | None, ...] | None = None
    attention_softcap: float | None = None  # scores soft-capped to c * tanh(scores / c) (Gemma 2)
    logits_softcap: float | None = None  # final logits soft-capped the same way (Gemma 2)
    local_rope_layers: tuple[bool, ...] | None = None  # per layer: uses the local RoPE base (Gemma 3's sliding layers)
    rope_layers: tuple[bool, ...] | None = None  # per layer: applies RoPE; None: every layer does
    # RoPE rotates interleaved pairs (2i, 2i + 1) of each head (ERNIE 4.5, Llama 4), not halves: q_proj's and
    # k_proj's rows (and LoRA B's) are reordered at load into halves, which our RoPE rotates alike (q and k move
    # together: the scores are unchanged; workers/rope.py, deinterleave_rows); no family with it has weighted
    # q/k norms (Llama 4's, without weight, are blind to the order)
    rope_interleaved: bool = False
    # (floor_scale, attn_scale): on the layers without RoPE, the query at position p is multiplied by
    # 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)) (Llama 4's attn_temperature_tuning); None: none
    query_temperature: tuple[float, float] | None = None
    embedding_multiplier: float = 1.0  # embeddings are scaled by it
    residual_multiplier: float = 1.0  # each attention and MLP output is scaled by it before the residual add
    attention_scale: float | None = None  # scores' scale; None: head_dim ** -0.5
    attention_sinks: bool = False  # each attention layer has a learned sink logit per head (self_attn.sinks)
    logits_scale: float = 1.0  # logits are multiplied by it
    moe: MoeTraits | None = None  # the mixture-of-experts MLP; None: every layer's MLP is dense
    mlp_block: str = "mlp"  # the dense MLP's name: model.layers.N.{mlp_block}.gate_proj.weight (Llama 4: feed_forward)
    # the dense MLPs' width where the config's intermediate_size is the experts' (Llama 4: intermediate_size_mlp);
    # None: intermediate_size
    dense_intermediate_size: int | None = None
    mla: MlaTraits | None = None  # multi-head latent attention in every layer (DeepSeek V3); None: q/k/v heads
    # q_proj gives each head's query and then its gate ([heads, 2, head_dim] rows, split at load); the attention's
    # output x sigmoid(gate) before o_proj (Qwen3-Next's full-attention layers)
    attention_output_gate: bool = False
    # layers a checkpoint may hold after the last decoder layer (model.layers.N... for N >= num_hidden_layers:
    # GLM-4.5's and DeepSeek V3's multi-token-prediction layers), which we do not run and skip at load
    num_extra_layers: int = 0
    # tensors outside the layers that a checkpoint may hold and we do not run, by name prefix, skipped at load
    # (Qwen3-Next's multi-token-prediction module, "mtp.")
    skipped_prefixes: tuple[str, ...] = ()
    # per layer: the kind of the layer that keeps a fixed-size state per sequence in attention's place
    # (workers/recurrent.py): "short_conv" (LFM2), "mamba2" (Granite 4), "gated_delta" (Qwen3-Next), "kda"
    # (Kimi Linear); None: attention. None: every layer attends
    mixers: tuple[str | None, ...] | None = None
    short_conv_width: int = 3  # "short_conv" layers: tokens the convolution spans (LFM2's conv_L_cache)
    short_conv_bias: bool = False  # "short_conv" layers: their in, conv and out products carry biases
    mamba2: Mamba2Traits | None = None  # "mamba2" layers (Granite 4's mamba layers, workers/mamba2.py)
    gated_delta: GatedDeltaTraits | None = None  # "gated_delta" layers' shapes (workers/gated_delta.py)
    kda: KdaTraits | None = None  # "kda" layers' shapes (workers/kda.py)
    # each layer's mixer runs beside its attention on the same normed input, their outputs summed (Falcon-H1):
    # the layer keeps both its keys and values and its state; False: the mixer runs in attention's place
    mixers_beside_attention: bool = False
    multipliers: ProductMultipliers | None = None  # constants folded into the layers' products at load; None: none
    # the checkpoint's names for what ours are called, as (theirs, ours) fragments replaced in every
    # tensor name at load (LFM2's operator_norm is our input_layernorm); (): the same names
    tensor_names: tuple[tuple[str, str], ...] = ()
    # per layer: its head_dim and key/value heads where some layers differ from the config's (Gemma 4's
    # full-attention layers: global_head_dim, num_global_key_value_heads); None: head_dim and
    # num_key_value_heads in every layer
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    # per layer: the earlier layer whose K/V pool it reads, computing no K/V of its own and writing none
    # (Gemma 4's num_kv_shared_layers); None: its own pool. None: every layer has its own
    kv_sources: tuple[int | None, ...] | None = None
    # per layer: v is k's projection before k's norm and RoPE (no v_proj: Gemma 4's attention_k_eq_v on its
    # full-attention layers); None: every layer has a v_proj
    k_eq_v_layers: tuple[bool, ...] | None = None
    value_norm: bool = False  # each value head RMS-normalised without a weight before the pool (Gemma 4)
    layer_scalars: bool = False  # each layer's output, the whole residual stream, x its layer_scalar [1] (Gemma 4)
    # Gemma 4's per-layer inputs: a [T, num_layers, this] input per token from a second embedding table and a
    # projection of the embeddings, gated into each layer's residual stream after its MLP; 0: none
    per_layer_input_size: int = 0
    layer_intermediate_sizes: tuple[int, ...] | None = None  # per layer: its dense MLP's width; None: the config's


@dataclass(frozen=True, slots=True)
class ProductMultipliers:
    """Constants that multiply a layer's products (Falcon-H1's µP multipliers). Each is folded into
    the weights at load (workers/model.py, _WeightReader.fold_multipliers), so the loop runs none."""

    attention_in: float = 1.0  # q, k and v read x * attention_in (attention_in_multiplier)
    key: float = 1.0  # k (its bias included) x key, before RoPE (key_multiplier)
    attention_out: float = 1.0  # o_proj's output, its bias included (attention_out_multiplier)
    gate: float = 1.0  # the MLP's gate product, before the activation (mlp_multipliers[0])
    down: float = 1.0  # the MLP's down product (mlp_multipliers[1])


ROUTER_SCORINGS = ("softmax_topk", "sigmoid_topk", "topk_softmax", "topk_sigmoid")
EXPERT_LAYOUTS = ("stacked", "gpt_oss", "in_out")
GATED_DELTA_PROJECTIONS = ("qkvz_ba", "qkv_z_b_a")


@dataclass(frozen=True, slots=True)
class MoeTraits:
    """A mixture-of-experts MLP (workers/moe.py): which layers have one, how the router weighs
    the experts, and what a classic checkpoint calls their tensors (transformers' fused layout,
    mlp.gate + mlp.experts.gate_up_proj / down_proj, is read for every family)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's gated-SiLU width
    layers: tuple[bool, ...]  # per layer: True: the MoE MLP; False: the dense MLP (ModelConfig.intermediate_size)
    scoring: str = "softmax_topk"  # "softmax_topk": softmax over every expert's logit, then the top k;
    #                                "sigmoid_topk": each logit's sigmoid, then the top k;
    #                                "topk_softmax": the top k logits, then softmax over those k;
    #                                "topk_sigmoid": the top k logits, then each one's sigmoid (Llama 4)
    renormalize: bool = True  # softmax_topk, sigmoid_topk: the k weights are divided by their sum
    # the k weights multiply each chosen expert's input (x * w through the expert, Llama 4), not its output
    weight_inputs: bool = False
    # a per-expert bias added to the scores only to choose the k (the weights stay unbiased): the names its
    # tensor ([E], or [1, E]) may have under the block, the first present is read (GLM-4.5:
    # "gate.e_score_correction_bias"); (): none
    correction_bias: tuple[str, ...] = ()
    # group-limited top k: the experts are num_groups equal groups, each scored by the sum of its two best
    # (biased) scores, and only the experts of the topk_groups best groups can be chosen; 1: no groups
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # the k weights' multiplier (after renormalising)
    router_bias: bool = False  # the router's logits carry a bias (its tensor {block}.{router}.bias)
    router: str = "gate"  # the router's name: model.layers.N.{block}.{router}.weight
    block: str = "mlp"  # classic names: model.layers.N.{block}.gate.weight, {block}.experts.E.{projection}.weight
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    expert_layout: str = "stacked"  # "stacked": transformers' fused [E, out, in] tensors or the classic ones;
    #                                 "gpt_oss": [E, in, out], gate and up interleaved, biases, or MXFP4;
    #                                 "in_out": {block}.experts.gate_up_proj [E, in, out] with gate then up,
    #                                 down_proj [E, in, out], no biases (Llama 4)
    activation: str | None = None  # the experts' gated activation (workers/layer_ops.py); None: the model's
    swiglu_alpha: float = 1.702  # activation "swiglu_oai": the sigmoid's gain
    swiglu_limit: float = 7.0  # activation "swiglu_oai": the clamp on gate (above) and up (both sides)
    # a shared expert: a dense gated MLP of this width on every token, beside the routed experts
    # (model.layers.N.{block}.{shared_expert}.{gate,up,down}_proj); 0: none
    shared_intermediate_size: int = 0
    shared_expert: str = "shared_expert"  # its name (GLM-4.5's n_shared_experts are one MLP: "shared_experts")
    shared_expert_gate: bool = False  # the shared expert's output x sigmoid(x . {block}.shared_expert_gate.weight)

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise FamilyError(f"{self.top_k} experts per token out of {self.num_experts} experts")
        if self.scoring not in ROUTER_SCORINGS:
            raise FamilyError(f"router scoring {self.scoring!r} is not one of {ROUTER_SCORINGS}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise FamilyError(f"expert layout {self.expert_layout!r} is not one of {EXPERT_LAYOUTS}")
        if self.num_groups > 1:
            group_size = self.num_experts // self.num_groups
            if self.num_experts % self.num_groups or group_size < 2:
                raise FamilyError(f"{self.num_experts} experts do not split into n_group {self.num_groups} groups "
                                  "of two or more")
            if not 0 < self.topk_groups <= self.num_groups or self.top_k > self.topk_groups * group_size:
                raise FamilyError(f"top {self.top_k} experts from topk_group {self.topk_groups} of {self.num_groups} "
                                  f"groups of {group_size}")


@dataclass(frozen=True, slots=True)
class MlaTraits:
    """Multi-head latent attention (workers/mla.py): the cache holds, per token and layer, one
    normed latent (kv_lora_rank) and one RoPE key shared by every head (qk_rope_head_dim)."""

    kv_lora_rank: int  # the latent's width (what kv_b_proj expands to per-head k_nope and v)
    qk_nope_head_dim: int  # each head's key/query part without RoPE
    qk_rope_head_dim: int  # each head's query part with RoPE, and the shared key's
    v_head_dim: int  # each head's value width
    q_lora_rank: int | None  # q through q_a_proj, q_a_layernorm, q_b_proj of this rank; None: one q_proj
    rope_interleave: bool = True  # RoPE rotates pairs (x0, x1), (x2, x3), ...: those rows are de-interleaved at load
    norm_eps: float = 1e-6  # q_a_layernorm's and kv_a_layernorm's (transformers' default, not rms_norm_eps)
    rope: bool = True  # q's RoPE part and the shared key are rotated; False: used as they are (Kimi Linear's NoPE)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values one token keeps per layer in the pool: its latent and its RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class Mamba2Traits:
    """A Mamba-2 mixer (workers/mamba2.py, Granite 4's mamba layers): in_proj splits each token into
    a gate (inner), the convolved x ++ B ++ C (conv_channels) and a time step per head; the state of
    a sequence is the conv's last conv_kernel - 1 inputs and an SSM state per head."""

    num_heads: int
    head_dim: int  # num_heads * head_dim is the mixer's inner width
    state_size: int  # N: each head's state is [head_dim, N]
    num_groups: int  # B and C are shared by num_heads / num_groups heads each; the gated norm's groups
    conv_kernel: int  # the causal conv's width
    chunk_size: int  # a prompt's scan runs in chunks of this many tokens
    conv_bias: bool = True
    proj_bias: bool = False  # in_proj carries a bias
    out_proj_bias: bool = False  # out_proj carries a bias
    norm_eps: float = 1e-6
    time_step_min: float = 0.0  # each time step softplus(dt + dt_bias) is clamped to [min, max]
    time_step_max: float = math.inf
    # the gated RMSNorm before out_proj: "after_gate" (the norm of y * silu(gate): Granite 4), "before_gate"
    # (norm(y) * silu(gate)); None: no norm, y * silu(gate) (Falcon-H1's mamba_rms_norm false)
    gated_norm: str | None = "after_gate"
    # Falcon-H1's µP multipliers, folded into the weights at load (workers/mamba2.py): in_proj reads
    # x * input_multiplier (ssm_in_multiplier); its output's gate, x, B, C and dt parts are scaled by
    # in_proj_multipliers (ssm_multipliers); out_proj's output by output_multiplier (ssm_out_multiplier)
    input_multiplier: float = 1.0
    in_proj_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    output_multiplier: float = 1.0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise FamilyError(f"mamba_n_groups {self.num_groups} does not divide mamba_n_heads {self.num_heads}")
        if self.gated_norm not in (None, "after_gate", "before_gate"):
            raise FamilyError(f"gated norm {self.gated_norm!r} is not after_gate, before_gate or None")
        if len(self.in_proj_multipliers) != 5:
            raise FamilyError(f"ssm_multipliers needs 5 values (gate, x, B, C, dt), "
                              f"got {list(self.in_proj_multipliers)}")

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """x, B and C: what the causal conv runs over."""
        return self.inner + 2 * self.num_groups * self.state_size

    @property
    def in_proj_rows(self) -> int:
        return self.inner + self.conv_channels + self.num_heads

    @property
    def in_proj_parts(self) -> tuple[int, int, int, int, int]:
        """in_proj's output rows: gate, x, B, C, dt (in_proj_multipliers' order)."""
        width = self.num_groups * self.state_size
        return self.inner, self.inner, width, width, self.num_heads


def mamba2_traits(raw: dict) -> Mamba2Traits:
    """A granitemoehybrid config's Mamba-2 settings (transformers' GraniteMoeHybridConfig defaults); the
    inner width mamba_d_ssm where the config has one (Falcon-H1), else mamba_expand x hidden_size."""
    hidden, heads = int(raw["hidden_size"]), int(raw.get("mamba_n_heads", 128))
    d_ssm = raw.get("mamba_d_ssm")
    inner = int(raw.get("mamba_expand", 2)) * hidden if d_ssm is None else int(d_ssm)
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != inner:
        width = "mamba_expand x hidden_size" if d_ssm is None else "mamba_d_ssm"
        raise FamilyError(f"mamba_n_heads {heads} x mamba_d_head {head_dim} is not {width} {inner}")
    limit = raw.get("time_step_limit") or (0.0, math.inf)
    return Mamba2Traits(
        num_heads=heads, head_dim=head_dim, state_size=int(raw.get("mamba_d_state", 256)),
        num_groups=int(raw.get("mamba_n_groups", 1)), conv_kernel=int(raw.get("mamba_d_conv", 4)),
        chunk_size=int(raw.get("mamba_chunk_size", 256)), conv_bias=bool(raw.get("mamba_conv_bias", True)),
        proj_bias=bool(raw.get("mamba_proj_bias", False)), out_proj_bias=bool(raw.get("mamba_proj_bias", False)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        time_step_min=_json_float(limit[0]), time_step_max=_json_float(limit[1]),
    )


def _json_float(value) -> float:
    """A number from config.json, where transformers writes infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


@dataclass(frozen=True, slots=True)
class GatedDeltaTraits:
    """A Gated DeltaNet mixer (workers/gated_delta.py, Qwen3-Next's linear_attention layers): a
    causal convolution over q, k and v, then a linear attention whose state per value head is a
    [head_k_dim, head_v_dim] matrix, updated by the gated delta rule."""

    num_k_heads: int  # query and key heads (linear_num_key_heads)
    num_v_heads: int  # value heads (linear_num_value_heads), a multiple of num_k_heads
    head_k_dim: int  # each query and key head's width (linear_key_head_dim)
    head_v_dim: int  # each value head's width (linear_value_head_dim)
    conv_kernel: int  # the causal convolution's width (linear_conv_kernel_dim)
    # the checkpoint's input products: "qkvz_ba": in_proj_qkvz and in_proj_ba, each grouped by key head (q, k, v, z
    # of each key head in turn: Qwen3-Next); "qkv_z_b_a": in_proj_qkv (every q head, then k, then v), in_proj_z,
    # in_proj_b and in_proj_a (Qwen3.5). The same maths: both are fused into one product at load
    projections: str = "qkvz_ba"

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise FamilyError(f"{self.num_v_heads} value heads do not share {self.num_k_heads} key heads evenly")
        if self.projections not in GATED_DELTA_PROJECTIONS:
            raise FamilyError(f"Gated DeltaNet projections {self.projections!r} are not one of "
                              f"{GATED_DELTA_PROJECTIONS}")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True, slots=True)
class KdaTraits:
    """A Kimi Delta Attention mixer (workers/kda.py, Kimi Linear's linear_attention layers): a causal
    convolution over q, k and v of num_heads heads of head_dim each, then a linear attention whose
    state per head is a [head_dim, head_dim] matrix, decayed per key channel by the delta rule."""

    num_heads: int  # linear_attn_config's num_heads (transformers: linear_num_heads)
    head_dim: int  # linear_attn_config's head_dim (linear_head_dim)
    conv_kernel: int  # linear_attn_config's short_conv_kernel_size (linear_conv_kernel_dim)

    @property
    def conv_channels(self) -> int:
        """The convolution's channels: q, k and v side by side."""
        return 3 * self.num_heads * self.head_dim


def _llama(raw: dict) -> FamilyTraits:
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(qkv_bias=bias, o_bias=bias)


def _mistral(raw: dict) -> FamilyTraits:
    window = raw.get("sliding_window")
    return FamilyTraits(qkv_bias=False, o_bias=False, sliding_window=None if window is None else int(window))


def _qwen2(raw: dict) -> FamilyTraits:
    if raw.get("use_sliding_window", False):
        raise FamilyError("qwen2 with use_sliding_window=true is not supported")
    return FamilyTraits(qkv_bias=True, o_bias=False)


def _qwen3(raw: dict) -> FamilyTraits:
    if raw.get("use_sliding_window", False):
        raise FamilyError("qwen3 with use_sliding_window=true is not supported")
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(qkv_bias=bias, o_bias=bias, qk_norm="head")


def _smollm3(raw: dict) -> FamilyTraits:
    if raw.get("use_sliding_window", False):
        raise FamilyError("smollm3 with use_sliding_window=true is not supported")
    num_layers = int(raw["num_hidden_layers"])
    flags = raw.get("no_rope_layers")
    if flags is None:  # transformers' default: every no_rope_layer_interval-th layer has no RoPE
        interval = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((layer + 1) % interval != 0) for layer in range(num_layers)]
    if len(flags) != num_layers:
        raise FamilyError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(qkv_bias=bias, o_bias=bias, rope_layers=tuple(bool(flag) for flag in flags))


def _granite(raw: dict) -> FamilyTraits:
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(
        qkv_bias=bias, o_bias=bias,
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        attention_scale=float(raw.get("attention_multiplier", 1.0)),
        logits_scale=1.0 / float(raw.get("logits_scaling", 1.0)),
    )


def _olmo2(raw: dict) -> FamilyTraits:
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(qkv_bias=bias, o_bias=bias, qk_norm="projection", norms="post")


def _olmo3(raw: dict) -> FamilyTraits:
    default_types = ["sliding_attention" if (layer + 1) % 4 else "full_attention"
                     for layer in range(int(raw["num_hidden_layers"]))]  # transformers' Olmo3Config
    windows = _layer_windows(raw, default_types)
    return replace(_olmo2(raw), layer_windows=windows,
                   local_rope_layers=tuple(window is not None for window in windows))


def _exaone4(raw: dict) -> FamilyTraits:
    num_layers = int(raw["num_hidden_layers"])
    if not raw.get("sliding_window"):  # every layer full, every layer with RoPE
        return FamilyTraits(qkv_bias=False, o_bias=False, qk_norm="head", norms="post")
    pattern = int(raw.get("sliding_window_pattern") or 4)
    default_types = ["sliding_attention" if (layer + 1) % pattern else "full_attention" for layer in range(num_layers)]
    windows = _layer_windows(raw, default_types)
    return FamilyTraits(qkv_bias=False, o_bias=False, qk_norm="head", norms="post", layer_windows=windows,
                        rope_layers=tuple(window is not None for window in windows))  # global layers: NoPE


def _seed_oss(raw: dict) -> FamilyTraits:
    return FamilyTraits(qkv_bias=bool(raw.get("attention_bias", True)),
                        o_bias=bool(raw.get("attention_out_bias", False)))


def _phi3(raw: dict) -> FamilyTraits:
    window = raw.get("sliding_window")
    return FamilyTraits(qkv_bias=False, o_bias=False, sliding_window=None if window is None else int(window),
                        fused_projections=True)


def _layer_windows(raw: dict, default_types: list[str] | None = None) -> tuple[int | None, ...]:
    """Each layer's window from layer_types ("sliding_attention" / "full_attention"), or
    default_types where the config has none."""
    num_layers, window = int(raw["num_hidden_layers"]), raw.get("sliding_window")
    types = raw.get("layer_types") or default_types
    if types is None or len(types) != num_layers:
        raise FamilyError(f"{raw['model_type']} needs layer_types, one per layer ({num_layers})")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise FamilyError(f"layer_types {unknown} are not supported")
    if "sliding_attention" in types and not window:
        raise FamilyError("sliding_attention layers need sliding_window")
    return tuple(int(window) if kind == "sliding_attention" else None for kind in types)


def _gemma(raw: dict) -> dict:
    """What Gemma 2 and 3 share."""
    if raw.get("use_bidirectional_attention"):
        raise FamilyError(f"{raw['model_type']} with use_bidirectional_attention is not supported")
    bias = bool(raw.get("attention_bias", False))
    windows = _layer_windows(raw)
    return dict(
        qkv_bias=bias, o_bias=bias, norms="sandwich", norm_weight_offset=1.0, layer_windows=windows,
        embedding_multiplier=float(raw["hidden_size"]) ** 0.5,
        attention_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        attention_softcap=raw.get("attn_logit_softcapping") or None,
        logits_softcap=raw.get("final_logit_softcapping") or None,
    )


def _gemma2(raw: dict) -> FamilyTraits:
    return FamilyTraits(**_gemma(raw))


def _gemma3_text(raw: dict) -> FamilyTraits:
    shared = _gemma(raw)
    return FamilyTraits(**shared, qk_norm="head",
                        local_rope_layers=tuple(window is not None for window in shared["layer_windows"]))


def _gemma4_text(raw: dict) -> FamilyTraits:
    """Gemma 4's text model (transformers' Gemma4TextConfig): Gemma 3's sandwich norms and per-head q/k
    norms, but every norm x * w (no offset), a weightless norm of each value head, a scale of 1 on the
    scores, a layer_scalar on each layer's output, per-layer inputs, the last num_kv_shared_layers layers
    reading the pool of the last earlier layer of their type, and full-attention layers of their own head
    size (per_layer_config, or global_head_dim and num_global_key_value_heads) whose RoPE is
    "proportional" (workers/config.py)."""
    for key in ("enable_moe_block", "use_bidirectional_attention"):
        if raw.get(key):
            raise FamilyError(f"gemma4_text with {key}={raw[key]!r} is not supported")
    num_layers, windows = int(raw["num_hidden_layers"]), _layer_windows(raw)
    full = tuple(window is None for window in windows)
    head_dims, kv_heads = _gemma4_layer_shapes(raw, full)
    sources = _gemma4_kv_sources(num_layers, int(raw.get("num_kv_shared_layers") or 0), windows)
    width = int(raw["intermediate_size"])
    wide = bool(raw.get("use_double_wide_mlp")) and any(source is not None for source in sources)
    per_layer_size = int(raw.get("hidden_size_per_layer_input") or 0)
    if per_layer_size and int(raw.get("vocab_size_per_layer_input", raw["vocab_size"])) < int(raw["vocab_size"]):
        raise FamilyError(f"gemma4_text with vocab_size_per_layer_input {raw['vocab_size_per_layer_input']} below "
                          f"vocab_size {raw['vocab_size']} is not supported")
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(
        qkv_bias=bias, o_bias=bias, qk_norm="head", norms="sandwich", layer_windows=windows,
        local_rope_layers=tuple(not is_full for is_full in full), attention_scale=1.0,
        embedding_multiplier=float(raw["hidden_size"]) ** 0.5,
        logits_softcap=raw.get("final_logit_softcapping") or None,
        layer_head_dims=head_dims if len(set(head_dims)) > 1 else None,
        layer_kv_heads=kv_heads if len(set(kv_heads)) > 1 else None,
        kv_sources=sources if any(source is not None for source in sources) else None,
        k_eq_v_layers=full if raw.get("attention_k_eq_v") else None, value_norm=True, layer_scalars=True,
        per_layer_input_size=per_layer_size,
        layer_intermediate_sizes=tuple(width * 2 if wide and source is not None else width for source in sources),
    )


def _gemma4_layer_shapes(raw: dict, full: tuple[bool, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's (head_dim, key/value heads): per_layer_config's overrides where the config was saved by
    transformers (keys are layer indices), else the full-attention layers' global_head_dim (512 by default)
    and, with attention_k_eq_v, num_global_key_value_heads."""
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    kv_heads = int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    overrides = raw.get("per_layer_config")
    if overrides is None:
        shape = {"head_dim": raw.get("global_head_dim", 512)}
        if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
            shape["num_key_value_heads"] = raw["num_global_key_value_heads"]
        overrides = {str(layer): shape for layer, is_full in enumerate(full) if is_full}
    unknown = sorted({key for shape in overrides.values() for key in shape} - {"head_dim", "num_key_value_heads"})
    if unknown:
        raise FamilyError(f"gemma4_text's per_layer_config sets {unknown}, which are not supported")
    layers = [overrides.get(str(layer), {}) for layer in range(len(full))]
    return (tuple(int(shape.get("head_dim", head_dim)) for shape in layers),
            tuple(int(shape.get("num_key_value_heads", kv_heads)) for shape in layers))


def _gemma4_kv_sources(num_layers: int, num_shared: int, windows: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """Each layer's K/V source (transformers' kv_sharing_modes): the last num_shared layers read the pool of
    the last layer before them of their attention type; None: the layer's own."""
    first_shared = num_layers - num_shared
    if not 0 <= num_shared < num_layers:
        raise FamilyError(f"num_kv_shared_layers {num_shared} of {num_layers} layers leaves no layer to share from")
    sources: list[int | None] = [None] * num_layers
    for layer in range(first_shared, num_layers):
        same_type = [earlier for earlier in range(first_shared) if windows[earlier] == windows[layer]]
        if not same_type:
            raise FamilyError(f"layer {layer} shares K/V, but no earlier layer has its attention type")
        sources[layer] = same_type[-1]
    return tuple(sources)


def _mixtral(raw: dict) -> FamilyTraits:
    num_layers = int(raw["num_hidden_layers"])
    moe = MoeTraits(
        num_experts=int(raw.get("num_local_experts", 8)), top_k=int(raw.get("num_experts_per_tok", 2)),
        intermediate_size=int(raw["intermediate_size"]), layers=(True,) * num_layers,
        block="block_sparse_moe", expert_projections=("w1", "w3", "w2"),
    )
    return replace(_mistral(raw), moe=moe)


def _qwen3_moe(raw: dict) -> FamilyTraits:
    return replace(_qwen3(raw), moe=_qwen_moe(raw))


def _qwen2_moe(raw: dict) -> FamilyTraits:
    if raw.get("use_sliding_window", False):
        raise FamilyError("qwen2_moe with use_sliding_window=true is not supported")
    shared = int(raw.get("shared_expert_intermediate_size", 0))
    moe = _qwen_moe(raw, shared_intermediate_size=shared, shared_expert_gate=shared > 0)
    return FamilyTraits(qkv_bias=bool(raw.get("qkv_bias", True)), o_bias=False, moe=moe)


# transformers' defaults of the keys _qwen_moe reads, per family
QWEN_MOE_DEFAULTS = dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False)
QWEN3_NEXT_MOE_DEFAULTS = dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, norm_topk_prob=True)


def _qwen_moe(raw: dict, defaults: dict = QWEN_MOE_DEFAULTS, **shared) -> MoeTraits | None:
    """Qwen's MoE layers: every decoder_sparse_step-th layer but mlp_only_layers (None: no MoE layer)."""
    num_layers = int(raw["num_hidden_layers"])
    # transformers 5 saves num_local_experts
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", defaults["num_experts"])))
    step = int(raw.get("decoder_sparse_step", 1))
    if step < 1:
        raise FamilyError(f"decoder_sparse_step {step} is not a positive layer interval")
    dense = {int(layer) for layer in raw.get("mlp_only_layers") or ()}
    layers = tuple(num_experts > 0 and layer not in dense and (layer + 1) % step == 0 for layer in range(num_layers))
    if not any(layers):
        return None
    return MoeTraits(
        num_experts=num_experts, top_k=int(raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])),
        intermediate_size=int(raw.get("moe_intermediate_size", defaults["moe_intermediate_size"])), layers=layers,
        renormalize=bool(raw.get("norm_topk_prob", defaults["norm_topk_prob"])), **shared,
    )


def _qwen3_next(raw: dict) -> FamilyTraits:
    """Qwen3-Next: Gated DeltaNet layers (linear_attention) between full-attention layers whose q_proj
    also gives an output gate, per-head q/k norms, x * (1 + w) norms everywhere but the Gated
    DeltaNet's own; qwen2_moe's MoE layers with a gated shared expert, renormalised by default."""
    shared = int(raw.get("shared_expert_intermediate_size", 512))
    moe = _qwen_moe(raw, QWEN3_NEXT_MOE_DEFAULTS, shared_intermediate_size=shared, shared_expert_gate=shared > 0)
    return _gated_delta_family(raw, moe, "qkvz_ba", skipped_prefixes=("mtp.",))


def _qwen3_5_text(raw: dict) -> FamilyTraits:
    """Qwen3.5's dense text model: qwen3_next's layers with the Gated DeltaNet's four input products and
    a dense MLP of intermediate_size in every layer."""
    return _gated_delta_family(raw, None, "qkv_z_b_a", skipped_prefixes=QWEN3_5_SKIPPED)


def _qwen3_5_moe_text(raw: dict) -> FamilyTraits:
    """Qwen3.5's MoE text model (transformers' Qwen3_5MoeTextConfig defaults): every layer the top k of the
    softmax over the experts, renormalised, plus a shared expert gated by sigmoid(x . shared_expert_gate)."""
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 256)))
    shared = int(raw.get("shared_expert_intermediate_size", 512))
    width = int(raw.get("moe_intermediate_size", 512))
    moe = MoeTraits(num_experts=num_experts, top_k=int(raw.get("num_experts_per_tok", 8)), intermediate_size=width,
                    layers=(True,) * int(raw["num_hidden_layers"]), shared_intermediate_size=shared,
                    shared_expert_gate=shared > 0)
    # no layer is dense: the experts' width stands in for the dense MLP's, which config.json need not have
    return replace(_gated_delta_family(raw, moe, "qkv_z_b_a", skipped_prefixes=QWEN3_5_SKIPPED),
                   dense_intermediate_size=width)


# what a Qwen3.5 checkpoint holds that we do not run: its multi-token-prediction module, and the vision tower of
# the multimodal checkpoints it is published as (never read)
QWEN3_5_SKIPPED = ("mtp.", "model.visual.")


def _gated_delta_family(raw: dict, moe: MoeTraits | None, projections: str,
                        skipped_prefixes: tuple[str, ...]) -> FamilyTraits:
    """Qwen3-Next's and Qwen3.5's layers: Gated DeltaNet layers (linear_attention) between full-attention
    layers whose q_proj also gives an output gate, per-head q/k norms, x * (1 + w) norms everywhere but
    the Gated DeltaNet's own."""
    if raw.get("hidden_act", "silu") != "silu":  # also the Gated DeltaNet's convolution's activation
        raise FamilyError(f"{raw['model_type']} with hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    types = qwen3_next_layer_types(raw)
    bias = bool(raw.get("attention_bias", False))
    recurrent = "linear_attention" in types
    gated_delta = GatedDeltaTraits(
        num_k_heads=int(raw.get("linear_num_key_heads", 16)), num_v_heads=int(raw.get("linear_num_value_heads", 32)),
        head_k_dim=int(raw.get("linear_key_head_dim", 128)), head_v_dim=int(raw.get("linear_value_head_dim", 128)),
        conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)), projections=projections,
    ) if recurrent else None
    return FamilyTraits(qkv_bias=bias, o_bias=bias, qk_norm="head", norm_weight_offset=1.0,
                        attention_output_gate=True, moe=moe, skipped_prefixes=skipped_prefixes,
                        mixers=tuple("gated_delta" if kind == "linear_attention" else None for kind in types)
                        if recurrent else None, gated_delta=gated_delta)


def qwen3_next_layer_types(raw: dict) -> tuple[str, ...]:
    """Each layer's kind, "linear_attention" or "full_attention": layer_types, else every
    full_attention_interval-th layer full (transformers' Qwen3NextConfig and Qwen3.5's, default 4)."""
    num_layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        if interval < 1:
            raise FamilyError(f"full_attention_interval {interval} is not a positive layer interval")
        types = ["full_attention" if (layer + 1) % interval == 0 else "linear_attention" for layer in range(num_layers)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if len(types) != num_layers or unknown:
        raise FamilyError(f"{raw['model_type']} needs layer_types of linear_attention / full_attention, one per layer "
                          f"({num_layers}); got {types}")
    return tuple(types)


def _glm4_moe(raw: dict) -> FamilyTraits:
    return FamilyTraits(qkv_bias=bool(raw.get("attention_bias", False)), o_bias=False,
                        qk_norm="head" if raw.get("use_qk_norm", False) else None,
                        moe=_grouped_sigmoid_moe(raw, GLM4_MOE_DEFAULTS), num_extra_layers=_num_mtp_layers(raw))


# transformers' defaults of the keys _grouped_sigmoid_moe reads, per family
GLM4_MOE_DEFAULTS = dict(n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
                         n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1, norm_topk_prob=True)
DEEPSEEK_V3_MOE_DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                                n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                first_k_dense_replace=3, norm_topk_prob=True)


def _grouped_sigmoid_moe(raw: dict, defaults: dict) -> MoeTraits | None:
    """DeepSeek V3's MoE layers (GLM-4.5's too): dense MLPs in the first first_k_dense_replace layers,
    then sigmoid scores, e_score_correction_bias on the choice, group-limited top k, renormalised iff
    norm_topk_prob, x routed_scaling_factor, and n_shared_experts x moe_intermediate_size of ungated
    shared expert (mlp.shared_experts). None: no MoE layer (or no routed experts)."""
    def get(key):  # a null in config.json means transformers' default too
        return defaults[key] if raw.get(key) is None else raw[key]

    num_layers, width = int(raw["num_hidden_layers"]), int(get("moe_intermediate_size"))
    num_experts = int(raw["num_local_experts"] if raw.get("n_routed_experts") is None and
                      raw.get("num_local_experts") is not None else get("n_routed_experts"))
    layers = tuple(num_experts > 0 and layer >= int(get("first_k_dense_replace")) for layer in range(num_layers))
    if not any(layers):
        return None
    return MoeTraits(
        num_experts=num_experts, top_k=int(get("num_experts_per_tok")), intermediate_size=width, layers=layers,
        scoring="sigmoid_topk", renormalize=bool(get("norm_topk_prob")),
        correction_bias=("gate.e_score_correction_bias",),
        num_groups=int(get("n_group")), topk_groups=int(get("topk_group")),
        routed_scaling_factor=float(get("routed_scaling_factor")),
        shared_intermediate_size=width * int(get("n_shared_experts")), shared_expert="shared_experts",
    )


def _minimax_m2(raw: dict) -> FamilyTraits:
    num_layers = int(raw["num_hidden_layers"])
    moe = MoeTraits(
        num_experts=int(raw.get("num_local_experts", 256)), top_k=int(raw.get("num_experts_per_tok", 8)),
        intermediate_size=int(raw["intermediate_size"]), layers=(True,) * num_layers, scoring="sigmoid_topk",
        correction_bias=("e_score_correction_bias",), block="block_sparse_moe", expert_projections=("w1", "w3", "w2"),
    )
    return FamilyTraits(qkv_bias=False, o_bias=False, qk_norm="projection", moe=moe)


def _ernie4_5_moe(raw: dict) -> FamilyTraits:
    if raw.get("use_bias", False):
        raise FamilyError("ernie4_5_moe with use_bias=true is not supported")
    num_layers, width = int(raw["num_hidden_layers"]), int(raw.get("moe_intermediate_size", 1536))
    num_experts, interval = int(raw.get("moe_num_experts", 64)), int(raw.get("moe_layer_interval", 1))
    first, last = int(raw.get("moe_layer_start_index", 1)), int(raw.get("moe_layer_end_index", -1))
    last = num_layers - 1 if last == -1 else last
    if interval < 1:
        raise FamilyError(f"moe_layer_interval {interval} is not a positive layer interval")
    layers = tuple(num_experts > 0 and (layer + 1) % interval == 0 and first <= layer <= last
                   for layer in range(num_layers))
    moe = MoeTraits(
        num_experts=num_experts, top_k=int(raw.get("moe_k", 6)), intermediate_size=width, layers=layers,
        correction_bias=("moe_statics.e_score_correction_bias", "gate.moe_statics.e_score_correction_bias"),
        shared_intermediate_size=width * int(raw.get("moe_num_shared_experts", 2)), shared_expert="shared_experts",
    ) if any(layers) else None
    return FamilyTraits(qkv_bias=False, o_bias=False, rope_interleaved=True, moe=moe)


def _hunyuan_v1_moe(raw: dict) -> FamilyTraits:
    num_layers, width = int(raw["num_hidden_layers"]), int(raw["intermediate_size"])

    def one_value(key: str, default: int) -> int:  # published configs list some per layer
        values = raw.get(key, default)
        values = set(values) if isinstance(values, list) else {values}
        if len(values) != 1:
            raise FamilyError(f"hunyuan_v1_moe with {key} varying between layers is not supported")
        return int(values.pop())

    moe = MoeTraits(  # transformers' HunYuanMoEV1Moe: experts and shared MLP of intermediate_size, every layer
        num_experts=one_value("num_experts", 1), top_k=one_value("moe_topk", 1), intermediate_size=width,
        layers=(True,) * num_layers, router="gate.wg", shared_intermediate_size=width, shared_expert="shared_mlp",
    )
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(qkv_bias=bias, o_bias=bias, qk_norm="head_after_rope",
                        qk_norm_names=("query_layernorm", "key_layernorm"), moe=moe)


def _gpt_oss(raw: dict) -> FamilyTraits:
    num_layers = int(raw["num_hidden_layers"])
    alternating = ["sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(num_layers)]
    moe = MoeTraits(
        num_experts=int(raw.get("num_local_experts", 128)),
        top_k=int(raw.get("num_experts_per_tok") or raw.get("experts_per_token") or 4),
        intermediate_size=int(raw["intermediate_size"]), layers=(True,) * num_layers,
        scoring="topk_softmax", router_bias=True, router="router", expert_layout="gpt_oss", activation="swiglu_oai",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)), swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )
    bias = bool(raw.get("attention_bias", True))
    return FamilyTraits(qkv_bias=bias, o_bias=bias, layer_windows=_layer_windows(raw, alternating),
                        attention_sinks=True, moe=moe)


def _llama4_text(raw: dict) -> FamilyTraits:
    """Llama 4's text model (transformers' Llama4TextConfig defaults)."""
    num_layers = int(raw["num_hidden_layers"])
    rope_flags = raw.get("no_rope_layers") or [int((layer + 1) % int(raw.get("no_rope_layer_interval", 4)) != 0)
                                               for layer in range(num_layers)]  # 1: RoPE; empty: the default
    if len(rope_flags) < num_layers:
        raise FamilyError(f"no_rope_layers has {len(rope_flags)} entries for {num_layers} layers")
    rope_layers = tuple(bool(flag) for flag in rope_flags[:num_layers])
    chunk = raw.get("attention_chunk_size", 8192)
    types = raw.get("layer_types") or ["chunked_attention" if rope and chunk is not None else "full_attention"
                                       for rope in rope_layers]
    unknown = sorted(set(types) - {"chunked_attention", "full_attention"})
    if len(types) != num_layers or unknown:
        raise FamilyError(f"llama4_text needs layer_types of chunked_attention / full_attention, one per layer "
                          f"({num_layers}); got {types}")
    if "chunked_attention" in types and not chunk:
        raise FamilyError("chunked_attention layers need attention_chunk_size")
    chunks = tuple(int(chunk) if kind == "chunked_attention" else None for kind in types)
    moe_layers = raw.get("moe_layers")
    if moe_layers is None:
        step = int(raw.get("interleave_moe_layer_step", 1))
        if step < 1:
            raise FamilyError(f"interleave_moe_layer_step {step} is not a positive layer interval")
        moe_layers = range(step - 1, num_layers, step)
    moe_set, width = {int(layer) for layer in moe_layers}, int(raw.get("intermediate_size", 8192))
    layers = tuple(layer in moe_set for layer in range(num_layers))
    moe = MoeTraits(
        num_experts=int(raw.get("num_local_experts", 16)), top_k=int(raw.get("num_experts_per_tok", 1)),
        intermediate_size=width, layers=layers, scoring="topk_sigmoid", renormalize=False, weight_inputs=True,
        router="router", block="feed_forward", expert_layout="in_out", shared_intermediate_size=width,
    ) if any(layers) else None
    bias = bool(raw.get("attention_bias", False))
    temperature = (float(raw.get("floor_scale", 8192)), float(raw.get("attn_scale", 0.1)))
    return FamilyTraits(
        qkv_bias=bias, o_bias=bias, qk_norm="l2_after_rope" if raw.get("use_qk_norm", True) else None,
        layer_chunks=chunks if any(chunks) else None, rope_layers=rope_layers, rope_interleaved=True,
        query_temperature=temperature if raw.get("attn_temperature_tuning", True) else None,
        moe=moe, mlp_block="feed_forward", dense_intermediate_size=int(raw.get("intermediate_size_mlp", 16384)),
    )


def _deepseek_v3(raw: dict) -> FamilyTraits:
    q_lora_rank = raw.get("q_lora_rank", 1536)
    mla = MlaTraits(
        kv_lora_rank=int(raw.get("kv_lora_rank", 512)), qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)), v_head_dim=int(raw.get("v_head_dim") or 128),
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        rope_interleave=bool(raw.get("rope_interleave", True)),
    )
    bias = bool(raw.get("attention_bias", False))  # q_a_proj, kv_a_proj_with_mqa and o_proj
    return FamilyTraits(qkv_bias=bias, o_bias=bias, attention_scale=mla.qk_head_dim**-0.5 * _yarn_mscale_squared(raw),
                        mla=mla, moe=_grouped_sigmoid_moe(raw, DEEPSEEK_V3_MOE_DEFAULTS),
                        num_extra_layers=_num_mtp_layers(raw))


# transformers' KimiLinearConfig writes (and Moonshot's config.json has) these keys for deepseek_v3's
KIMI_LINEAR_KEYS = {"num_experts": "n_routed_experts", "num_local_experts": "n_routed_experts",
                    "num_experts_per_token": "num_experts_per_tok", "num_expert_group": "n_group",
                    "moe_renormalize": "norm_topk_prob", "num_shared_experts": "n_shared_experts"}
KIMI_LINEAR_MOE_DEFAULTS = dict(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=1024,
                                n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.446,
                                first_k_dense_replace=1, norm_topk_prob=True)


def _kimi_linear(raw: dict) -> FamilyTraits:
    """Kimi Linear: KDA layers (linear_attention, workers/kda.py) between MLA layers without RoPE
    (full_attention), deepseek_v3's MoE on the "sparse" layers of mlp_layer_types (else the first
    first_k_dense_replace layers dense)."""
    if raw.get("hidden_act", "silu") != "silu":  # also the KDA convolution's activation
        raise FamilyError(f"kimi_linear with hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    if raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise FamilyError(f"kimi_linear with moe_router_activation_func {raw['moe_router_activation_func']!r} "
                          "is not supported (sigmoid only)")
    if raw.get("mla_use_nope") is False:
        raise FamilyError("kimi_linear with mla_use_nope false (RoPE in the MLA layers) is not supported")
    moe_raw = dict(raw)
    for theirs, ours in KIMI_LINEAR_KEYS.items():
        if raw.get(theirs) is not None and raw.get(ours) is None:
            moe_raw[ours] = raw[theirs]
    moe_raw.pop("num_local_experts", None)
    moe = _grouped_sigmoid_moe(moe_raw, KIMI_LINEAR_MOE_DEFAULTS)
    if moe is not None:  # Moonshot's per-expert tensors: block_sparse_moe.experts.E.w1 / w3 / w2 (renamed mlp)
        moe = replace(moe, expert_projections=("w1", "w3", "w2"))
    num_layers, mlp_types = int(raw["num_hidden_layers"]), raw.get("mlp_layer_types")
    if moe is not None and mlp_types is not None:
        if len(mlp_types) != num_layers or set(mlp_types) - {"dense", "sparse"}:
            raise FamilyError(f"kimi_linear needs mlp_layer_types of dense / sparse, one per layer; got {mlp_types}")
        layers = tuple(kind == "sparse" for kind in mlp_types)
        moe = replace(moe, layers=layers) if any(layers) else None
    linear = raw.get("linear_attn_config") or {}
    kda = KdaTraits(num_heads=int(linear.get("num_heads", raw.get("linear_num_heads", 32))),
                    head_dim=int(linear.get("head_dim", raw.get("linear_head_dim", 128))),
                    conv_kernel=int(linear.get("short_conv_kernel_size", raw.get("linear_conv_kernel_dim", 4))))
    q_lora_rank = raw.get("q_lora_rank")
    mla = MlaTraits(
        kv_lora_rank=int(raw.get("kv_lora_rank", 512)), qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)), v_head_dim=int(raw.get("v_head_dim") or 128),
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank), rope_interleave=False, rope=False,
    )
    types = kimi_linear_layer_types(raw)
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(qkv_bias=bias, o_bias=bias, attention_scale=mla.qk_head_dim**-0.5, mla=mla, moe=moe,
                        mixers=tuple("kda" if kind == "linear_attention" else None for kind in types)
                        if "linear_attention" in types else None, kda=kda, num_extra_layers=0,
                        tensor_names=((".block_sparse_moe.", ".mlp."),))


def kimi_linear_layer_types(raw: dict) -> tuple[str, ...]:
    """Each layer's kind, "linear_attention" (KDA) or "full_attention" (MLA): layer_types, else
    linear_attn_config's 1-based kda_layers and full_attn_layers (Moonshot's config.json), else
    transformers' default (every fourth layer from layer 4, 0-based, full)."""
    num_layers = int(raw["num_hidden_layers"])
    types, linear = raw.get("layer_types"), raw.get("linear_attn_config") or {}
    if types is None and "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * num_layers
        for kind, key in (("full_attention", "full_attn_layers"), ("linear_attention", "kda_layers")):
            for layer in linear[key]:
                if not 1 <= int(layer) <= num_layers:
                    raise FamilyError(f"kimi_linear's linear_attn_config {key} names layer {layer} of {num_layers}")
                types[int(layer) - 1] = kind
    if types is None:
        types = ["full_attention" if layer and layer % 4 == 0 else "linear_attention" for layer in range(num_layers)]
    unknown = sorted(set(map(str, types)) - {"linear_attention", "full_attention"})
    if len(types) != num_layers or unknown:
        raise FamilyError(f"kimi_linear needs layer_types of linear_attention / full_attention, one per layer "
                          f"({num_layers}); got {types}")
    return tuple(types)


def _num_mtp_layers(raw: dict) -> int:
    """Multi-token-prediction layers a checkpoint holds after its last layer (transformers' default 1)."""
    return int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers", 1)))


def _lfm2(raw: dict) -> FamilyTraits:
    """LFM2: short-convolution layers (ShortConv, workers/short_conv.py) between full-attention ones, per
    layer_types (or full_attn_idxs); per-head q/k norms; an MLP of w1, w3, w2 whose width
    block_auto_adjust_ff_dim shrinks to 2/3, times block_ffn_dim_multiplier, rounded up to
    block_multiple_of."""
    num_layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types")
    if kinds is None:
        attention = set(raw.get("full_attn_idxs") or range(num_layers))
        kinds = ["full_attention" if layer in attention else "conv" for layer in range(num_layers)]
    if len(kinds) != num_layers or set(kinds) - {"conv", "full_attention"}:
        raise FamilyError(f"layer_types must name conv or full_attention for each of {num_layers} layers: {kinds}")
    width = int(raw.get("block_ff_dim", raw.get("intermediate_size", 12288)))
    if raw.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = int(raw.get("block_multiple_of", 256))
            width = multiple * -(-int(multiplier * width) // multiple)
    return FamilyTraits(
        qkv_bias=False, o_bias=False, qk_norm="head", qk_norm_names=("q_layernorm", "k_layernorm"),
        mlp_block="feed_forward", dense_intermediate_size=width,
        mixers=tuple("short_conv" if kind == "conv" else None for kind in kinds),
        short_conv_width=int(raw.get("conv_L_cache", 3)), short_conv_bias=bool(raw.get("conv_bias", False)),
        tensor_names=((".operator_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
                      (".self_attn.out_proj.", ".self_attn.o_proj."), (".feed_forward.w1.", ".feed_forward.gate_proj."),
                      (".feed_forward.w3.", ".feed_forward.up_proj."), (".feed_forward.w2.", ".feed_forward.down_proj."),
                      ("model.embedding_norm.", "model.norm.")),
    )


def _granitemoehybrid(raw: dict) -> FamilyTraits:
    """Granite 4 (transformers' GraniteMoeHybridConfig defaults): Mamba-2 layers and attention layers per
    layer_types, Granite's multipliers, RoPE only with position_embedding_type "rope"; each layer's MLP the
    shared_mlp (input_linear: gate and up as one tensor; output_linear), beside a MoE of num_local_experts
    (block_sparse_moe: top k router logits, softmax over those k) when there are any. The checkpoint's names
    are read as ours (tensor_names): the MLP's as mlp.gate_up_proj / down_proj, or as the MoE's shared expert."""
    num_layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or ["mamba"] * num_layers
    mamba, attention = {"mamba", "linear_attention"}, {"attention", "full_attention"}
    if len(kinds) != num_layers or set(kinds) - mamba - attention:
        raise FamilyError(f"layer_types must name mamba or attention for each of {num_layers} layers: {kinds}")
    num_experts = int(raw.get("num_local_experts") or 0)
    shared_width = int(raw.get("shared_intermediate_size", 1024))
    moe = MoeTraits(
        num_experts=num_experts, top_k=int(raw.get("num_experts_per_tok", 2)),
        intermediate_size=int(raw.get("intermediate_size", 11008)), layers=(True,) * num_layers,
        scoring="topk_softmax", shared_intermediate_size=shared_width,
    ) if num_experts > 0 else None
    mlp = "mlp.shared_expert" if moe is not None else "mlp"
    names = ((".shared_mlp.input_linear.", f".{mlp}.gate_up_proj."),
             (".shared_mlp.output_linear.", f".{mlp}.down_proj."),
             # the MoE: the checkpoint's layout, or transformers' own (save_original_format=False)
             (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
             (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
             (".block_sparse_moe.router.layer.", ".mlp.gate."), (".block_sparse_moe.router.", ".mlp.gate."),
             (".block_sparse_moe.experts.", ".mlp.experts."))
    rope = raw.get("position_embedding_type") == "rope"
    return replace(_granite(raw), rope_layers=None if rope else (False,) * num_layers, moe=moe,
                   dense_intermediate_size=shared_width,
                   mixers=tuple("mamba2" if kind in mamba else None for kind in kinds),
                   mamba2=mamba2_traits(raw), tensor_names=names)


def _falcon_h1(raw: dict) -> FamilyTraits:
    """Falcon-H1 (transformers' FalconH1Config defaults): in every layer attention and a Mamba-2 mixer read the
    same normed input and their outputs are summed; µP multipliers on the embeddings, the logits
    (lm_head_multiplier), attention's input, keys and output, the mixer's input, in_proj parts and output, and
    the MLP's gate and down products (all but the first two folded into the weights at load); the mixer's
    gated RMSNorm only with mamba_rms_norm; its names (feed_forward, pre_ff_layernorm, final_layernorm) read
    as ours (FamilyTraits.tensor_names)."""
    num_layers = int(raw["num_hidden_layers"])
    gate, down = raw.get("mlp_multipliers") or (1.0, 1.0)
    defaults = dict(mamba_d_ssm=raw.get("mamba_d_ssm", 1024), rms_norm_eps=raw.get("rms_norm_eps", 1e-5))
    mamba2 = replace(
        mamba2_traits({**raw, **defaults}), out_proj_bias=bool(raw.get("projectors_bias", False)),
        gated_norm=("before_gate" if raw.get("mamba_norm_before_gate", True) else "after_gate")
        if raw.get("mamba_rms_norm", False) else None,
        input_multiplier=float(raw.get("ssm_in_multiplier", 1.0)),
        in_proj_multipliers=tuple(float(m) for m in raw.get("ssm_multipliers") or (1.0,) * 5),
        output_multiplier=float(raw.get("ssm_out_multiplier", 1.0)),
    )
    bias = bool(raw.get("attention_bias", False))
    return FamilyTraits(
        qkv_bias=bias, o_bias=bias, mlp_block="feed_forward",
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        logits_scale=float(raw.get("lm_head_multiplier", 1.0)),
        mixers=("mamba2",) * num_layers, mamba2=mamba2, mixers_beside_attention=True,
        multipliers=ProductMultipliers(
            attention_in=float(raw.get("attention_in_multiplier", 1.0)), key=float(raw.get("key_multiplier", 1.0)),
            attention_out=float(raw.get("attention_out_multiplier", 1.0)), gate=float(gate), down=float(down)),
        tensor_names=((".pre_ff_layernorm.", ".post_attention_layernorm."), ("model.final_layernorm.", "model.norm.")),
    )


def _yarn_mscale_squared(raw: dict) -> float:
    """DeepSeek's softmax scale factor under yarn: mscale(factor, mscale_all_dim) ** 2, as transformers'
    yarn_apply_mscale (1 without scaling or without mscale_all_dim)."""
    params = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    factor, mscale_all_dim = params.get("factor"), params.get("mscale_all_dim")
    if params.get("rope_type", params.get("type", "default")) == "default" or not mscale_all_dim or not factor:
        return 1.0
    mscale = 1.0 if float(factor) <= 1 else 0.1 * float(mscale_all_dim) * math.log(float(factor)) + 1.0
    return mscale * mscale


FAMILIES: dict[str, Callable[[dict], FamilyTraits]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "smollm3": _smollm3,
    "granite": _granite,
    "olmo2": _olmo2,
    "olmo3": _olmo3,
    "seed_oss": _seed_oss,
    "exaone4": _exaone4,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gemma4_text": _gemma4_text,
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "glm4_moe": _glm4_moe,
    "minimax_m2": _minimax_m2,
    "ernie4_5_moe": _ernie4_5_moe,
    "hunyuan_v1_moe": _hunyuan_v1_moe,
    "gpt_oss": _gpt_oss,
    "llama4_text": _llama4_text,
    "deepseek_v3": _deepseek_v3,
    "lfm2": _lfm2,
    "granitemoehybrid": _granitemoehybrid,
    "qwen3_next": _qwen3_next,
    "qwen3_5_text": _qwen3_5_text,
    "qwen3_5_moe_text": _qwen3_5_moe_text,
    "falcon_h1": _falcon_h1,
    "kimi_linear": _kimi_linear,
}

# Multimodal model_types whose text model we serve -> that text model's model_type (the vision
# tower's tensors are skipped at load).
MULTIMODAL_TEXT_MODELS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "llama4": "llama4_text",
                          "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# model_types whose config.json has no intermediate_size: every MLP is a mixture of experts
EXPERTS_ONLY_FAMILIES = frozenset({"qwen3_5_moe_text"})
SUPPORTED_MODEL_TYPES = (*FAMILIES, *MULTIMODAL_TEXT_MODELS)
# RoPE scaling names a family's older configs use for one of ours (transformers renames them the same way)
ROPE_TYPE_ALIASES = {"phi3": {"su": "longrope", "yarn": "longrope"}}
# partial_rotary_factor where a family's config has none (and no rotary_dim): transformers' default for it
PARTIAL_ROTARY_DEFAULTS = {"glm4_moe": 0.5, "qwen3_next": 0.25, "qwen3_5_text": 0.25, "qwen3_5_moe_text": 0.25}
# tensors read in fp32 whatever the model's dtype, as transformers keeps them: a correction bias's small
# differences between experts decide the choice, and bf16 would round them away
FP32_TENSOR_SUFFIXES = ("e_score_correction_bias",)
MXFP4_FAMILIES = frozenset({"gpt_oss"})  # MXFP4 checkpoints: its experts only
GGUF_NATIVE_FAMILIES = frozenset({"llama"})  # GGUF files whose blocks the CPU kernels serve as they ship


@dataclass(frozen=True, slots=True)
class FamilyPaths:
    """Which of our paths a model of this family and these traits can take: for each, None where
    it can, else why not. The one table the loader, the runner and the C layer loop ask."""

    c_layer_loop: str | None  # the C layer loop on CPU (workers/native_forward.py); else the Python loop
    gguf_native: str | None  # a GGUF file served in its own blocks by the CPU kernels; else dequantized
    packed_quant_on_cuda: str | None  # a quantized checkpoint's linears kept packed for Triton; else dequantized


def family_paths(model_type: str, traits: FamilyTraits) -> FamilyPaths:
    moe = "mixture-of-experts layers" if traits.moe is not None else None
    mla = "multi-head latent attention layers" if traits.mla is not None else None
    multiplier = "a residual multiplier" if traits.residual_multiplier != 1.0 else None
    late_norms = "q/k norms after RoPE" if traits.qk_norm in ("head_after_rope", "l2_after_rope") else None
    chunks = "chunked attention layers" if traits.layer_chunks is not None else None
    temperature = "query temperature tuning" if traits.query_temperature is not None else None
    gate = "an attention output gate" if traits.attention_output_gate else None
    recurrent = "layers with a recurrent state" if traits.mixers is not None else None  # the C loop calls their mixers
    # ... in attention's place: a layer with both has no C form
    parallel = "attention and Mamba-2 in parallel" if traits.mixers_beside_attention else None
    gemma4 = ("per-layer inputs, value norms and layer scalars" if traits.per_layer_input_size or traits.value_norm
              or traits.layer_scalars else None)
    shared_kv = "layers reading another layer's K/V" if traits.kv_sources is not None else None
    head_dims = "head sizes that differ between layers" if traits.layer_head_dims is not None else None
    return FamilyPaths(
        # the experts' MLP, latent attention, late q/k norms, chunked layers, query temperatures, output gates,
        # mixers beside attention and Gemma 4's parts have no C form: the Python loop runs them (MLA in torch;
        # chunked attention over our kernels)
        c_layer_loop=", ".join(why for why in (moe, mla, late_norms, chunks, temperature, gate, parallel, gemma4,
                                               shared_kv, head_dims) if why) or None,
        gguf_native=None if model_type in GGUF_NATIVE_FAMILIES else "GGUF checkpoints are served natively for "
        f"model_type {', '.join(map(repr, sorted(GGUF_NATIVE_FAMILIES)))} only",
        # grouped experts take plain weights; a multiplier is folded into them; q_proj's rows are split at load
        packed_quant_on_cuda=", ".join(why for why in (moe, mla, multiplier, gate, recurrent) if why) or None,
    )


def rope_type_of(model_type: str | None, rope_type: str) -> str:
    """A config's RoPE scaling name in ours."""
    return ROPE_TYPE_ALIASES.get(model_type or "", {}).get(rope_type, rope_type)
