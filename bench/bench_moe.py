"""A mixture-of-experts decode step on CPU against its products alone and against a dense step
of the same active parameters, at Qwen3-30B-A3B's layer shapes with random weights.

    .venv/bin/python -m bench.bench_moe                                  # 2 layers, batch 1 and 16, fp32, 2 threads
    .venv/bin/python -m bench.bench_moe --dtype bfloat16 --layers 4 --batch-sizes 1,4,16
    .venv/bin/python -m bench.bench_moe --layers 1 --batch-sizes 2 --experts 8 --hidden 128 \\
        --moe-intermediate 32 --heads 4 --kv-heads 2 --head-dim 32 --repeats 1          # a smoke run

Qwen3-30B-A3B's layer: hidden 2048, 32 query heads and 4 KV heads of 128, 128 experts of
width 768, top 8 (renormalised). The model is built in-process (no checkpoint file) through
PagedLlamaModel.from_hf_weights, with the default CPU backends (our attention, C ops and
packed products); --layers of them, no lm_head in the timing. Each sequence of a batch decodes
one token over a context of --context tokens. Reported per batch size, all in one run:

- MoE step: the median wall time of the model's forward for the decode step (the Python layer
  loop: the C loop has no MoE);
- experts GEMM: the expert products alone (each chosen expert's gate_up and down, at the row
  counts the step's router gave it), and all GEMM: those plus qkv, o and the router;
- experts used: distinct experts per layer (what the step reads: that many experts' weights);
- dense step: a Qwen3 model with the same attention and a dense MLP of intermediate top_k x
  moe_intermediate (6144: the same active parameters per token), its forward (the C loop where
  it runs) and its products alone.

Memory: the default (2 layers, fp32) holds about 5 GB of expert weights, twice that where the
fp32 panels keep a oneDNN copy (AVX2); use --dtype bfloat16 or fewer --experts on small machines.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import torch  # noqa: E402

import workers.moe as moe_module  # noqa: E402
from workers.config import ModelConfig  # noqa: E402
from workers.kernels import get_attention_backend, resolve_attention_backend_name  # noqa: E402
from workers.layer_ops import select_layer_ops  # noqa: E402
from workers.linear import select_linear_backend  # noqa: E402
from workers.model import AttentionMetadata, PagedLlamaModel  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 1024  # the lm_head is not timed; a small vocabulary keeps the model small


def model_config(args: argparse.Namespace, dense: bool) -> ModelConfig:
    raw = dict(model_type="qwen3" if dense else "qwen3_moe", vocab_size=VOCAB, hidden_size=args.hidden,
               intermediate_size=args.top_k * args.moe_intermediate, num_hidden_layers=args.layers,
               num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
               num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
               norm_topk_prob=True, max_position_embeddings=args.context + 64, rms_norm_eps=1e-6)
    return ModelConfig.from_dict(raw)


def random_tensors(config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint-named random weights (transformers' fused expert layout for MoE layers), each
    matrix scaled by 1 / sqrt(its input width) so activations stay O(1)."""
    def matrix(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype) * shape[-1] ** -0.5

    c, hidden = config, config.hidden_size
    tensors = {"model.embed_tokens.weight": matrix(c.vocab_size, hidden),
               "lm_head.weight": matrix(c.vocab_size, hidden), "model.norm.weight": torch.ones(hidden, dtype=dtype)}
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
            p + "self_attn.q_proj.weight": matrix(c.num_heads * c.head_dim, hidden),
            p + "self_attn.k_proj.weight": matrix(c.num_kv_heads * c.head_dim, hidden),
            p + "self_attn.v_proj.weight": matrix(c.num_kv_heads * c.head_dim, hidden),
            p + "self_attn.o_proj.weight": matrix(hidden, c.num_heads * c.head_dim),
            p + "self_attn.q_norm.weight": torch.ones(c.head_dim, dtype=dtype),
            p + "self_attn.k_norm.weight": torch.ones(c.head_dim, dtype=dtype),
        })
        if c.is_moe_layer(layer):
            m = c.traits.moe
            tensors[p + "mlp.gate.weight"] = matrix(m.num_experts, hidden)
            tensors[p + "mlp.experts.gate_up_proj"] = matrix(m.num_experts, 2 * m.intermediate_size, hidden)
            tensors[p + "mlp.experts.down_proj"] = matrix(m.num_experts, hidden, m.intermediate_size)
        else:
            tensors[p + "mlp.gate_proj.weight"] = matrix(c.intermediate_size, hidden)
            tensors[p + "mlp.up_proj.weight"] = matrix(c.intermediate_size, hidden)
            tensors[p + "mlp.down_proj.weight"] = matrix(hidden, c.intermediate_size)
    return tensors


def build(config: ModelConfig, dtype: torch.dtype, num_blocks: int):
    heads = (config.num_heads, config.num_kv_heads, config.head_dim)
    attention_name = resolve_attention_backend_name(None, "cpu", dtype, heads, BLOCK_SIZE)
    attention = get_attention_backend(attention_name)
    model = PagedLlamaModel.from_hf_weights(
        config, random_tensors(config, dtype), "cpu", attention, config.max_position_embeddings,
        linear=select_linear_backend(None, "cpu", dtype), ops=select_layer_ops(None, "cpu", dtype))
    kv_caches = [attention.allocate_kv_cache(num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim, dtype)
                 for _ in range(config.num_layers)]
    return model, kv_caches


def decode_step(batch: int, context: int):
    """(input ids, positions, metadata): each of batch sequences decodes its token context + 1."""
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    block_tables = (1 + torch.arange(batch * blocks_per_seq, dtype=torch.int32)).view(batch, blocks_per_seq)
    positions = torch.full((batch,), context, dtype=torch.int64)
    slots = block_tables[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    metadata = AttentionMetadata(
        slot_mapping=slots, block_tables=block_tables,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
    )
    input_ids = torch.randint(3, VOCAB, (batch,), generator=torch.Generator().manual_seed(batch))
    return input_ids, positions, metadata


@contextmanager
def recording_expert_counts(counts: list[list[int]]):
    """Appends each MoE layer's per-expert token counts while the forward runs."""
    original = moe_module.run_experts

    def recorded(x, routing, expert_ids, weights, linear, act_mul):
        counts.append(torch.bincount(expert_ids.flatten(), minlength=weights.traits.num_experts).tolist())
        return original(x, routing, expert_ids, weights, linear, act_mul)

    moe_module.run_experts = recorded
    try:
        yield
    finally:
        moe_module.run_experts = original


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def products(model: PagedLlamaModel, batch: int, counts: list[list[int]] | None) -> tuple:
    """(experts-only, all) closures over the step's products: attention's qkv and o per layer, and
    the MLP's: the dense gate_up and down at batch rows, or the router at batch rows and each
    chosen expert at its count (counts: per MoE layer, in layer order)."""
    c, dtype = model.config, model.dtype
    x = torch.randn(batch, c.hidden_size).to(dtype)
    attended = torch.randn(batch, c.num_heads * c.head_dim).to(dtype)
    width = c.traits.moe.intermediate_size if c.traits.moe is not None else c.intermediate_size
    act = torch.randn(max(batch * (c.traits.moe.top_k if c.traits.moe else 1), 1), width).to(dtype)
    rows = x.repeat(c.traits.moe.top_k if c.traits.moe else 1, 1)
    moe_layers = iter(counts or [])
    plan = [(layer, next(moe_layers) if layer.moe is not None else None) for layer in model.layers]

    def experts_only() -> None:
        for layer, layer_counts in plan:
            if layer.moe is None:
                model.linear(act[:batch], layer.down, layer.down_bias)
                model.linear(x, layer.gate_up, layer.gate_up_bias)
                continue
            for expert, count in enumerate(layer_counts):
                if count:
                    model.linear(rows[:count], layer.moe.gate_up[expert], None)
                    model.linear(act[:count], layer.moe.down[expert], None)

    def everything() -> None:
        for layer, _ in plan:
            model.linear(x, layer.qkv, layer.qkv_bias)
            model.linear(attended, layer.o, layer.o_bias)
            if layer.moe is not None:
                model.linear_backend.logits(x, layer.moe.router)
        experts_only()

    return experts_only, everything


def run(args: argparse.Namespace) -> list[dict]:
    """Prints the table; returns its rows (batch, times in seconds, each MoE layer's expert counts)."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    num_blocks = 1 + max(batches) * -(-(args.context + 1) // BLOCK_SIZE)
    models = {}
    for name, dense in (("moe", False), ("dense", True)):
        config = model_config(args, dense)
        models[name] = build(config, dtype, num_blocks)
    moe_model, dense_model = models["moe"][0], models["dense"][0]
    print(f"layers {args.layers} | hidden {args.hidden} | {args.experts} experts of {args.moe_intermediate}, top "
          f"{args.top_k} | dense twin intermediate {args.top_k * args.moe_intermediate} | {args.dtype} | "
          f"threads {torch.get_num_threads()} | context {args.context} | linear {moe_model.linear_backend.name} | "
          f"dense layer loop {'c' if dense_model.native_forward is not None else 'python'} | "
          f"load average {os.getloadavg()[0]:.2f}")
    header = (f"{'batch':>5} | {'MoE step ms':>11} | {'experts GEMM ms':>15} | {'all GEMM ms':>11} | "
              f"{'step/GEMM':>9} | {'experts used':>12} | {'dense step ms':>13} | {'dense GEMM ms':>13} | "
              f"{'MoE/dense':>9}")
    print(header)
    print("-" * len(header))
    rows = []
    with torch.inference_mode():
        for batch in batches:
            step = decode_step(batch, args.context)
            counts: list[list[int]] = []
            with recording_expert_counts(counts):
                moe_model.forward(*step, models["moe"][1])
            step_s = median_s(lambda: moe_model.forward(*step, models["moe"][1]), args.repeats)
            experts_s, all_s = (median_s(fn, args.repeats) for fn in products(moe_model, batch, counts))
            dense_s = median_s(lambda: dense_model.forward(*step, models["dense"][1]), args.repeats)
            dense_gemm_s = median_s(products(dense_model, batch, None)[1], args.repeats)
            used = statistics.mean(sum(1 for count in layer if count) for layer in counts)
            print(f"{batch:>5} | {step_s * 1e3:11.2f} | {experts_s * 1e3:15.2f} | {all_s * 1e3:11.2f} | "
                  f"{step_s / all_s:9.2f} | {used:12.1f} | {dense_s * 1e3:13.2f} | {dense_gemm_s * 1e3:13.2f} | "
                  f"{step_s / dense_s:9.2f}")
            rows.append(dict(batch=batch, step_s=step_s, experts_gemm_s=experts_s, all_gemm_s=all_s, dense_s=dense_s,
                             dense_gemm_s=dense_gemm_s, expert_counts=counts))
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,16", help="sequences decoding together, comma-separated")
    parser.add_argument("--context", type=int, default=256, help="tokens each sequence has before its decode step")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the median counts")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
