"""Every model family the tests build as a tiny random checkpoint, in one place.

Each entry maps a name (also the checkpoint directory's name) to transformers config overrides
for tests/tiny_model.py's build_tiny_model_dir, `model_type` included. The worker tests
(tests/workers/test_families.py) compare every path on FAMILIES; the served test
(tests/integration/test_families_served.py) serves every entry of SERVED_FAMILIES over HTTP.
A new family goes into one of the dicts here (or a new dict joined into SERVED_FAMILIES), and
both tests pick it up.
"""

from __future__ import annotations

# Llama and the families that run on Llama's layer unchanged but for biases and a context cap
LLAMA_FAMILIES = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral"),
    "qwen2": dict(model_type="qwen2"),  # q, k and v biases
}

# the families beyond Llama (workers/families.py)
FAMILIES = {
    # per-head q/k norms (a head_dim that is not hidden / heads), and again with attention biases
    "qwen3": dict(model_type="qwen3", head_dim=24),
    "qwen3-bias": dict(model_type="qwen3", attention_bias=True),
    # layers 1 and 3 of 4 without RoPE (transformers' default interval, here 2)
    "smollm3": dict(model_type="smollm3", num_hidden_layers=4, no_rope_layer_interval=2),
    "granite": dict(model_type="granite", embedding_multiplier=4.0, residual_multiplier=0.4,
                    attention_multiplier=0.09, logits_scaling=3.0),
    # sandwich norms x (1 + w), GELU-tanh MLPs, scaled embeddings, windows of 8 on layers 0 and 2 (prompts
    # run past them), attention and final logits soft-capped hard enough to change tokens
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
    # as Gemma 2 without soft-caps, plus per-head q/k norms and a local RoPE base on the sliding layers
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                             sliding_attention=dict(rope_type="default", rope_theta=1e4))),
    # the text model inside a multimodal checkpoint (a vision tower and projector beside it, skipped)
    "gemma3": dict(model_type="gemma3", head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Gemma 4's text model: 5 layers, windows of 8 on 0, 2 and 3 (prompts run past them); the full-attention layers
    # 1 and 4 with heads of 32 (global_head_dim) and proportional RoPE (a quarter of the frequencies nonzero); layers
    # 3 and 4 share K/V (num_kv_shared_layers) with layers 2 and 1, the last of their type before them; per-layer
    # inputs of 8 per layer; random layer scalars; final logits soft-capped
    "gemma4_text": dict(model_type="gemma4_text", num_hidden_layers=5, head_dim=16, global_head_dim=32,
                        sliding_window=8, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=384, final_logit_softcapping=8.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                                     "full_attention"]),
    # the same with v = k's projection on the full-attention layers (attention_k_eq_v), which have 1 K/V head
    # (num_global_key_value_heads), and double-wide MLPs on the layers sharing K/V (use_double_wide_mlp)
    "gemma4_text-k-eq-v": dict(model_type="gemma4_text", num_hidden_layers=5, head_dim=16, global_head_dim=32,
                               sliding_window=8, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
                               vocab_size_per_layer_input=384, attention_k_eq_v=True, num_global_key_value_heads=1,
                               use_double_wide_mlp=True,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                            "sliding_attention", "full_attention"]),
    # norms after each branch, q/k norms over the whole projection
    "olmo2": dict(model_type="olmo2"),
    # olmo2's norms, sliding windows of 8 on layers 0 and 1 (prompts run past them), full attention on layer 2
    # with a linearly scaled RoPE, the sliding layers' RoPE of another base
    "olmo3": dict(model_type="olmo3", sliding_window=8,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                  rope_parameters=dict(full_attention=dict(rope_type="linear", factor=2.0, rope_theta=5e5),
                                       sliding_attention=dict(rope_type="default", rope_theta=1e4))),
    # norms after each branch, per-head q/k norms, windows of 8 with RoPE on layers 0 and 1, layer 2 full and NoPE
    "exaone4": dict(model_type="exaone4", sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    # q, k and v biases, an o bias and MLP biases, a head_dim that is not hidden / heads
    "seed_oss": dict(model_type="seed_oss", attention_out_bias=True, mlp_bias=True, head_dim=24),
    # short-convolution layers 0, 1 and 3 (a state per sequence: the last 2 inputs of a 3-token kernel, with biases),
    # full attention with per-head q/k norms on layer 2; the MLP width from block_ff_dim (auto-adjusted: 2/3, x 1.5,
    # rounded up to 16)
    "lfm2": dict(model_type="lfm2", num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"],
                 conv_bias=True, conv_L_cache=3, block_ff_dim=96, block_ffn_dim_multiplier=1.5, block_multiple_of=16),
    # Granite 4: Mamba-2 layers 0, 1 and 3 (4 heads of 32 in 2 groups, a state of 8, a 4-token conv window, chunks
    # of 8: prompts cross several), attention without RoPE on layer 2; granite's multipliers; the shared_mlp of
    # width 96 as every layer's MLP (no experts)
    "granitemoehybrid": dict(model_type="granitemoehybrid", num_hidden_layers=4,
                             layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=0,
                             shared_intermediate_size=96, mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
                             mamba_d_conv=4, mamba_chunk_size=8, embedding_multiplier=4.0, residual_multiplier=0.4,
                             attention_multiplier=0.09, logits_scaling=3.0),
    # Falcon-H1: attention and a Mamba-2 mixer side by side in each of 3 layers (6 heads of 16 = mamba_d_ssm 96,
    # not 2 x hidden; 2 groups, a state of 8, a 4-token conv window, chunks of 8: prompts cross several, and KV
    # blocks of 4); the gated RMSNorm before the gate; every µP multiplier away from 1
    "falcon_h1": dict(model_type="falcon_h1", mamba_d_ssm=96, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=8,
                      mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=True, mamba_norm_before_gate=True,
                      embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=0.7,
                      key_multiplier=1.3, attention_out_multiplier=0.8, ssm_in_multiplier=1.2, ssm_out_multiplier=0.6,
                      ssm_multipliers=[0.9, 1.1, 0.8, 1.25, 1.5], mlp_multipliers=[1.2, 0.7]),
    # the same without the mixer's norm (y * silu(gate)), with every bias: attention, MLP, in_proj (mamba_proj_bias)
    # and out_proj (projectors_bias)
    "falcon_h1-biases": dict(model_type="falcon_h1", mamba_d_ssm=64, mamba_n_heads=4, mamba_n_groups=1,
                             mamba_d_state=8, mamba_chunk_size=8, mamba_rms_norm=False, attention_bias=True,
                             mlp_bias=True, mamba_proj_bias=True, projectors_bias=True, embedding_multiplier=1.5,
                             lm_head_multiplier=2.0, key_multiplier=0.6, attention_out_multiplier=1.4,
                             ssm_out_multiplier=0.5, ssm_multipliers=[1.3, 0.7, 1.1, 0.9, 0.6],
                             mlp_multipliers=[0.8, 1.3]),
    # Qwen3-Next: Gated DeltaNet layers 0, 1 and 3 (a state per sequence: a conv over 4 tokens' q, k, v and a
    # [16, 8] matrix per value head, 2 key heads each shared by 2 value heads), full attention on layer 2 (q_proj's
    # output gate, per-head q/k norms, a quarter of each head rotated); every norm x (1 + w) but the Gated
    # DeltaNet's own; layer 0 a dense MLP, 1-3 MoE: top 2 of 4 renormalised plus a gated shared expert
    "qwen3_next": dict(model_type="qwen3_next", num_hidden_layers=4, head_dim=16,
                       layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[0]),
    # Qwen3.5 as published: the text model inside a multimodal checkpoint (a vision tower beside it and the text
    # model under model.language_model., skipped and renamed); qwen3_next's layers (Gated DeltaNet layers 0, 1 and
    # 3, 2 key heads each shared by 2 value heads; gated full attention on layer 2) with the Gated DeltaNet's four
    # input products (in_proj_qkv, _z, _b, _a) and a dense MLP in every layer; half of each head rotated, with an
    # interleaved mrope_section that text positions make plain RoPE
    "qwen3_5": dict(model_type="qwen3_5", num_hidden_layers=4, head_dim=16,
                    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                         mrope_section=[2, 1, 1], mrope_interleaved=True)),
    # Qwen3.5's MoE, multimodal as published: full attention on layer 1 (a quarter of each head rotated, the
    # default), Gated DeltaNet layers 0, 2 and 3 (4 key heads each shared by 2 value heads); every layer the top 2 of
    # 4 experts, renormalised, plus a shared expert of width 48 gated by sigmoid(x . shared_expert_gate). Seed 2: with
    # seed 0 transformers' own fp32 logprobs stray 2.5e-3 from its fp64 ones at one position (ours 1.4e-4), past the
    # tests' 1e-3
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", num_hidden_layers=4, head_dim=16,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
                        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, seed=2),
    # fused qkv_proj and gate_up_proj, a quarter of each head rotated, longrope past 512 positions
    # (the attention factor scales cos and sin everywhere)
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5, original_max_position_embeddings=512,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                      short_factor=[1.0, 1.3, 1.7, 2.2], long_factor=[1.5, 2.0, 3.0, 4.5])),
    # multi-head latent attention over a latent cache, every layer dense (first_k_dense_replace: all of them);
    # q through the low-rank pair, interleaved RoPE, attention biases, yarn with mscale_all_dim (the softmax scale)
    "deepseek_v3": dict(model_type="deepseek_v3", num_key_value_heads=4, first_k_dense_replace=3, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, attention_bias=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                             mscale_all_dim=0.7, original_max_position_embeddings=256)),
    # Kimi Linear: KDA layers 0, 2, 3 (a per-channel decay, a sigmoid output gate) and an MLA layer 1 without RoPE
    # (q through one q_proj); layer 0 dense (mlp_layer_types), 1 to 3 MoE: the top 3 of 8 experts from the best 2
    # of 4 groups, x 2.446, and a shared expert; transformers' key names (num_experts, num_expert_group, ...)
    "kimi_linear": dict(model_type="kimi_linear", num_hidden_layers=4, num_key_value_heads=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                        linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, kv_lora_rank=16,
                        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, num_local_experts=8,
                        num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=32,
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    # the same with one q_proj (q_lora_rank null), RoPE in halves, no biases, no scaling
    "deepseek_v3-q-proj": dict(model_type="deepseek_v3", num_key_value_heads=4, first_k_dense_replace=3,
                               q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
                               v_head_dim=10, rope_interleave=False),
}

# mixtures of experts (tests/workers/test_moe.py)
MOE_FAMILIES = {
    # 6 experts, top 2, renormalised; the classic per-expert tensors (block_sparse_moe.experts.E.w1/w3/w2)
    "mixtral": dict(model_type="mixtral", num_local_experts=6, num_experts_per_tok=2),
    # the same in transformers' own layout (mlp.experts.gate_up_proj / down_proj, 3-D)
    "mixtral-fused": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, seed=1,
                          save_original_format=False),
    # q/k norms, 8 experts of width 48, top 2 not renormalised (Qwen3-30B-A3B's norm_topk_prob is true: next)
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=False),
    # 4 layers: 0 and 2 dense (mlp_only_layers, width 128), 1 and 3 MoE (top 3 of 5, renormalised)
    "qwen3_moe-dense-layers": dict(model_type="qwen3_moe", num_hidden_layers=4, num_experts=5, num_experts_per_tok=3,
                                   moe_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[0, 2]),
    # qwen3_moe's routing (top 2 of 5, not renormalised) with q, k, v biases and a gated shared expert of width
    # 56 in layers 1 and 2; layer 0 dense
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=5, num_experts_per_tok=2, moe_intermediate_size=40,
                      shared_expert_intermediate_size=56, norm_topk_prob=False, mlp_only_layers=[0]),
    # layer 0 dense (first_k_dense_replace), 1 and 2 MoE: sigmoid scores plus random correction biases choose
    # the top 3 of 8 experts from the best 2 of 4 groups (n_group), weights renormalised and x 2.5; a shared
    # expert of width 2 x 32; per-head q/k norms, q, k, v biases, half of each head rotated (the default)
    "glm4_moe": dict(model_type="glm4_moe", first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3,
                     n_group=4, topk_group=2, moe_intermediate_size=32, n_shared_experts=2, routed_scaling_factor=2.5,
                     norm_topk_prob=True, use_qk_norm=True, attention_bias=True),
    # deepseek_v3's latent attention (as FAMILIES' "deepseek_v3", with no biases or yarn) and glm4_moe's MoE layers:
    # layer 0 dense, 1 and 2 the top 3 of 8 experts from the best 2 of 4 groups, x 2.5, and a shared expert
    "deepseek_v3-moe": dict(model_type="deepseek_v3", num_key_value_heads=4, first_k_dense_replace=1, q_lora_rank=24,
                            kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                            moe_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=2.5),
    # sigmoid scores plus random correction biases choose the top 2 of 6 experts, renormalised; q/k norms over
    # the whole projection; a rotary_dim of 8 of head_dim 16; the classic per-expert tensors (block_sparse_moe)
    "minimax_m2": dict(model_type="minimax_m2", num_local_experts=6, num_experts_per_tok=2, intermediate_size=48,
                       head_dim=16, rotary_dim=8),
    # RoPE over interleaved pairs; layer 0 dense (moe_layer_start_index), 1 and 2 MoE: softmax scores plus random
    # correction biases ([1, E]) choose the top 2 of 6 experts, renormalised; a shared expert of width 2 x 32
    "ernie4_5_moe": dict(model_type="ernie4_5_moe", moe_num_experts=6, moe_k=2, moe_intermediate_size=32,
                         moe_num_shared_experts=2, moe_layer_start_index=1),
    # per-head q/k norms after RoPE, RoPE "dynamic" with Hunyuan's alpha (a fixed larger base); every layer MoE:
    # top 2 of 6 experts of width 48 (softmax, renormalised) plus a shared MLP of that width
    "hunyuan_v1_moe": dict(model_type="hunyuan_v1_moe", num_experts=6, moe_topk=2, intermediate_size=48, head_dim=16,
                           rope_parameters=dict(rope_type="dynamic", alpha=50.0, factor=1.0, rope_theta=10000.0)),
    # gpt-oss: attention biases and sinks, windows of 8 on layers 0 and 2 (prompts run past them), yarn RoPE;
    # top 2 of 4 experts by a biased router, softmax over the two; experts [E, in, out] with gate and up
    # interleaved and biases; a clamped SwiGLU whose limit of 4 the values reach
    "gpt_oss": dict(model_type="gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=4.0,
                    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=256)),
    # Llama 4's text model: layers 0-2 with RoPE over interleaved pairs, chunked attention in chunks of 6 (boundaries
    # mid-block for blocks of 4 and 16; prompts run past several) and weightless q/k norms after RoPE; layer 3
    # without RoPE, over every key, its queries temperature-tuned (floor_scale 4: the factor grows from position 3);
    # layers 1 and 3 MoE (interleave_moe_layer_step): the top 2 of 4 experts' sigmoids scaling the experts' inputs,
    # a shared expert of width 48; layers 0 and 2 dense MLPs of width 96 (intermediate_size_mlp)
    "llama4_text": dict(model_type="llama4_text", head_dim=16, num_hidden_layers=4, attention_chunk_size=6,
                        interleave_moe_layer_step=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=48,
                        intermediate_size_mlp=96, floor_scale=4, attn_scale=0.5),
    # Granite 4 with experts: Mamba-2 layers 0 and 2, attention with RoPE on layer 1; every layer the top 2 of 4
    # experts of width 48 (softmax over the two logits) plus the shared_mlp of width 56 (the checkpoint's names:
    # block_sparse_moe.input_linear / output_linear / router.layer, shared_mlp.input_linear / output_linear)
    "granitemoehybrid-moe": dict(model_type="granitemoehybrid", layer_types=["mamba", "attention", "mamba"],
                                 position_embedding_type="rope", num_local_experts=4, num_experts_per_tok=2,
                                 intermediate_size=48, shared_intermediate_size=56, mamba_n_heads=4, mamba_d_state=8,
                                 mamba_chunk_size=8, residual_multiplier=0.5),
    # Qwen3-Next with every layer full attention (its Gated DeltaNet layers: FAMILIES' "qwen3_next"): q_proj's rows
    # each head's query then its output gate, per-head q/k norms and every norm x (1 + w), a quarter of each head
    # rotated (the default), q, k, v and o biases; layer 0 dense (mlp_only_layers), 1 and 2 MoE: top 2 of 5
    # experts renormalised (the default) plus a shared expert of width 56 gated by sigmoid(x . shared_expert_gate)
    "qwen3_next-full-attention": dict(model_type="qwen3_next", head_dim=16, layer_types=["full_attention"] * 3,
                                      attention_bias=True, num_experts=5, num_experts_per_tok=2,
                                      moe_intermediate_size=40, shared_expert_intermediate_size=56,
                                      mlp_only_layers=[0]),
}

# the same text model inside a multimodal checkpoint (as Llama 4's are published: a vision model and projector beside
# it, skipped)
MOE_FAMILIES["llama4"] = dict(MOE_FAMILIES["llama4_text"], model_type="llama4")

# Gemma 4's text model inside its multimodal checkpoint (a vision tower and embedder beside it, skipped)
FAMILIES["gemma4"] = dict(FAMILIES["gemma4_text"], model_type="gemma4")

# every family served over HTTP: the dicts above, one checkpoint per MoE model_type (names must not collide)
SERVED_MOE = {name: MOE_FAMILIES[name] for name in ("mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe", "minimax_m2",
                                                  "ernie4_5_moe", "hunyuan_v1_moe", "deepseek_v3-moe", "gpt_oss",
                                                  "llama4_text", "llama4")}
# variants of a served model_type that the worker tests cover alone (each app served costs the HTTP test's waves time)
WORKER_ONLY = frozenset({"gemma4_text-k-eq-v"})
SERVED_FAMILIES = {**LLAMA_FAMILIES, **{name: traits for name, traits in FAMILIES.items() if name not in WORKER_ONLY},
                   **SERVED_MOE}
assert len(SERVED_FAMILIES) == len(LLAMA_FAMILIES) + len(FAMILIES) - len(WORKER_ONLY) + len(SERVED_MOE), \
    "a family name appears twice"

