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
    # norms after each branch, q/k norms over the whole projection
    "olmo2": dict(model_type="olmo2"),
    # fused qkv_proj and gate_up_proj, a quarter of each head rotated, longrope past 512 positions
    # (the attention factor scales cos and sin everywhere)
    "phi3": dict(model_type="phi3", partial_rotary_factor=0.5, original_max_position_embeddings=512,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
                                      short_factor=[1.0, 1.3, 1.7, 2.2], long_factor=[1.5, 2.0, 3.0, 4.5])),
}

# every family served over HTTP: the union of the dicts above (names must not collide)
SERVED_FAMILIES = {**LLAMA_FAMILIES, **FAMILIES}
assert len(SERVED_FAMILIES) == len(LLAMA_FAMILIES) + len(FAMILIES), "a family name appears twice"

