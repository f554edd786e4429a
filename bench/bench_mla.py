"""Decode steps of multi-head latent attention (workers/mla.py) on CPU: the absorbed form decodes
take against the expanded form prompts take, side by side in one run, with random weights at
DeepSeek V3's attention widths and fewer heads.

    .venv/bin/python -m bench.bench_mla                                 # 16 heads, 1 layer, fp32, 1 thread
    .venv/bin/python -m bench.bench_mla --heads 4 --batch-sizes 1 --contexts 64 --repeats 1   # a smoke run

The model (deepseek_v3, every layer dense, hidden 2048, kv_lora_rank 512, qk_rope_head_dim 64,
qk_nope_head_dim 128, v_head_dim 128, q_proj) is built in-process through
PagedLlamaModel.from_hf_weights with the default CPU backends (its attention: torch). Each
sequence of a batch decodes one token over --contexts tokens. Reported per (batch, context): the
median forward of the step, absorbed and expanded, their ratio, the largest difference of their
hidden states, and the pool's bytes per token against per-head keys and values.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from bench.bench_moe import decode_step  # noqa: E402
from workers import mla  # noqa: E402
from workers.config import ModelConfig  # noqa: E402
from workers.kernels import get_attention_backend  # noqa: E402
from workers.layer_ops import select_layer_ops  # noqa: E402
from workers.linear import select_linear_backend  # noqa: E402
from workers.model import PagedLlamaModel  # noqa: E402
from workers.model_runner import kv_bytes_per_token  # noqa: E402

BLOCK_SIZE = 16  # bench_moe's decode_step lays its blocks out by this size


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig.from_dict(dict(
        model_type="deepseek_v3", vocab_size=1024, hidden_size=2048, intermediate_size=1024,
        num_hidden_layers=args.layers, first_k_dense_replace=args.layers, num_attention_heads=args.heads,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_position_embeddings=max(args.contexts) + 64, rope_interleave=False))


def random_tensors(config: ModelConfig) -> dict[str, torch.Tensor]:
    """Checkpoint-named random weights, each matrix scaled by 1 / sqrt(its input width)."""
    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(*shape) * shape[-1] ** -0.5

    c, t, hidden = config, config.traits.mla, config.hidden_size
    tensors = {"model.embed_tokens.weight": matrix(c.vocab_size, hidden), "lm_head.weight": matrix(c.vocab_size, hidden),
               "model.norm.weight": torch.ones(hidden)}
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": matrix(c.num_heads * t.qk_head_dim, hidden),
            p + "self_attn.kv_a_proj_with_mqa.weight": matrix(t.cache_width, hidden),
            p + "self_attn.kv_a_layernorm.weight": torch.ones(t.kv_lora_rank),
            p + "self_attn.kv_b_proj.weight": matrix(c.num_heads * (t.qk_nope_head_dim + t.v_head_dim), t.kv_lora_rank),
            p + "self_attn.o_proj.weight": matrix(hidden, c.num_heads * t.v_head_dim),
            p + "mlp.gate_proj.weight": matrix(c.intermediate_size, hidden),
            p + "mlp.up_proj.weight": matrix(c.intermediate_size, hidden),
            p + "mlp.down_proj.weight": matrix(hidden, c.intermediate_size),
        })
    return tensors


def timed_step(model, kv_caches, batch: int, context: int, absorb: bool, repeats: int) -> tuple[float, torch.Tensor]:
    """(median ms, hidden states) of the decode step with decodes absorbed or expanded."""
    original = mla.MlaStep.__init__

    def chosen(self, metadata, scale, absorb_decodes=True):
        original(self, metadata, scale, absorb_decodes=absorb)

    mla.MlaStep.__init__ = chosen
    try:
        input_ids, positions, metadata = decode_step(batch, context)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            hidden = model.forward(input_ids, positions, metadata, kv_caches)
            times.append((time.perf_counter() - started) * 1e3)
    finally:
        mla.MlaStep.__init__ = original
    return statistics.median(times), hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.contexts = [int(value) for value in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = model_config(args)
    t = config.traits.mla
    model = PagedLlamaModel.from_hf_weights(
        config, random_tensors(config), "cpu", get_attention_backend("torch"), config.max_position_embeddings,
        linear=select_linear_backend(None, "cpu", torch.float32), ops=select_layer_ops(None, "cpu", torch.float32))
    plain = config.num_layers * config.num_heads * (t.qk_head_dim + t.v_head_dim) * 4
    print(f"pool bytes per token (fp32): {kv_bytes_per_token(config, torch.float32)} against {plain} with per-head "
          f"K and V ({plain / kv_bytes_per_token(config, torch.float32):.1f}x); {config.num_heads} heads, "
          f"{config.num_layers} layers, {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print("| batch | context | absorbed ms | expanded ms | expanded / absorbed | max difference |")
    print("|---|---|---|---|---|---|")
    for batch in map(int, args.batch_sizes.split(",")):
        for context in args.contexts:
            num_blocks = batch * -(-(context + 1) // BLOCK_SIZE) + 1
            kv_caches = [mla.allocate_latent_cache(num_blocks, BLOCK_SIZE, t, torch.float32, "cpu")
                         for _ in range(config.num_layers)]
            for pool, _ in kv_caches:
                pool.normal_()  # a context of random latents and keys
            absorbed, absorbed_hidden = timed_step(model, kv_caches, batch, context, True, args.repeats)
            expanded, expanded_hidden = timed_step(model, kv_caches, batch, context, False, args.repeats)
            difference = float((absorbed_hidden - expanded_hidden).abs().max())
            print(f"| {batch} | {context} | {absorbed:.1f} | {expanded:.1f} | {expanded / absorbed:.1f} | "
                  f"{difference:.1e} |")


if __name__ == "__main__":
    main()
