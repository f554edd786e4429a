"""Our model runner on a CUDA GPU: decode throughput eager and with CUDA graphs, against
Hugging Face generate on the same weights, and the Triton attention kernel against torch_ref.

    python -m bench.bench_gpu                         # SmolLM2-135M shapes, random bf16 weights
    python -m bench.bench_gpu --batch-sizes 1,64 --skip-attention
    python -m bench.bench_gpu --shape llama-3.2-1b --batch-sizes 1,16,64 --skip-attention
    python -m bench.bench_gpu --model /models/SmolLM2-135M-Instruct

GPU machines lent to this project reach no model hub and take at most 64 MiB of files, so
by default the weights are random, in SmolLM2-135M-Instruct's exact shapes (30 layers, 576
wide, 9 query and 3 KV heads of 64, vocabulary 49152, tied embeddings), or with --shape
llama-3.2-1b in Llama-3.2-1B's (16 layers, 2048 wide, 32 query and 8 KV heads of 64, MLP 8192,
vocabulary 128256, tied embeddings, llama3 RoPE scaling). Speed does not
depend on the weights' values; agreement in greedy tokens does, so the 'same tokens' column
is only a sanity check there.

Runner rows (per batch size, prompt --prompt-len random tokens, exactly --new-tokens new,
greedy, EOS ignored; best of --repeats):
- end-to-end tokens/s (prefill included) and decode tokens/s (the prefill step excluded),
  for our runner with the Triton backend eagerly, with CUDA graphs for decode steps, and HF
  generate (sdpa attention, its default dynamic cache);
- our median decode step, wall.

Attention rows: median time of one `paged_attention` call over --attention-repeats, Triton
vs torch_ref (which gathers each sequence's pages and calls SDPA), SmolLM2's head shapes,
at decode batches of --attention-batches sequences of --context keys, and one prefill of
--prefill-len tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_runner import make_prompts, run_hf, run_ours, tokens_per_s
from workers.model_runner import ModelRunner, RunnerConfig

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA_32_1B}
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def write_random_model(model_dir: Path, config: dict, seed: int = 0) -> None:
    """config.json + model.safetensors with HF tensor names, bf16, weights ~ N(0, 1/fan_in)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) / shape[-1] ** 0.5).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(config["vocab_size"], hidden) * hidden ** 0.5 / 8,
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            prefix + "self_attn.q_proj.weight": weight(q_out, hidden),
            prefix + "self_attn.k_proj.weight": weight(kv_out, hidden),
            prefix + "self_attn.v_proj.weight": weight(kv_out, hidden),
            prefix + "self_attn.o_proj.weight": weight(hidden, q_out),
            prefix + "mlp.gate_proj.weight": weight(inter, hidden),
            prefix + "mlp.up_proj.weight": weight(inter, hidden),
            prefix + "mlp.down_proj.weight": weight(hidden, inter),
        }
    model_dir.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))


def _decode_rows(args: argparse.Namespace, model_dir: Path, batch_sizes: list[int]) -> None:
    blocks_per_seq = -(-(args.prompt_len + args.new_tokens) // 16)
    base = dict(model=str(model_dir), dtype=args.dtype, device=args.device, block_size=16,
                num_blocks=max(batch_sizes) * blocks_per_seq + 64, attention_backend=args.attention_backend)
    on_cuda = args.device.startswith("cuda")
    reserved_before = torch.cuda.memory_reserved() if on_cuda else 0
    sides: dict[str, object] = {"ours eager": ModelRunner(RunnerConfig(**base, cuda_graph_batch_sizes=()))}
    if on_cuda and args.attention_backend == "triton":
        eager_bytes = torch.cuda.memory_reserved() - reserved_before  # weights + KV pool of one runner
        sizes = tuple(size for size in GRAPH_SIZES if size <= max(batch_sizes))
        started = time.perf_counter()
        sides["ours graphs"] = ModelRunner(RunnerConfig(**base, cuda_graph_batch_sizes=sizes))
        graphs_bytes = torch.cuda.memory_reserved() - reserved_before - 2 * eager_bytes
        print(f"captured CUDA graphs for decode batches {sizes} in {time.perf_counter() - started:.1f} s; "
              f"memory reserved by the capture beyond the runner's weights and KV pool: {graphs_bytes / 2**20:.0f} MiB "
              f"(the runner's own: {eager_bytes / 2**20:.0f} MiB)", flush=True)
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        sides["HF generate"] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype), attn_implementation="sdpa").to(args.device).eval()
    vocab = sides["ours eager"].model_info.vocab_size
    warm = make_prompts(2, 16, vocab, seed=99)
    for side in sides.values():
        run_ours(side, warm, 4) if isinstance(side, ModelRunner) else run_hf(side, warm, 4)
    header = (f"{'batch':>5} | {'side':<11} | {'tok/s':>9} {'decode':>9} | {'step ms':>7} | "
              f"{'vs HF':>5} | same tokens as eager")
    print(header + "\n" + "-" * len(header), flush=True)
    for batch_size in batch_sizes:
        prompts = make_prompts(batch_size, args.prompt_len, vocab)
        results: dict[str, tuple] = {}
        for name, side in sides.items():
            runs = []
            for _ in range(args.repeats):
                if isinstance(side, ModelRunner):
                    runs.append(run_ours(side, prompts, args.new_tokens))
                else:
                    runs.append((run_hf(side, prompts, args.new_tokens), None))
            results[name] = min(runs, key=lambda pair: pair[0].total_s)
        hf_e2e = tokens_per_s(results["HF generate"][0], batch_size, args.new_tokens)[0] if "HF generate" in results else None
        eager_tokens = results["ours eager"][0].token_ids
        for name, (result, breakdown) in results.items():
            e2e, decode = tokens_per_s(result, batch_size, args.new_tokens)
            step = f"{breakdown.step_s * 1e3:7.2f}" if breakdown else f"{'-':>7}"
            ratio = f"{e2e / hf_e2e:5.2f}" if hf_e2e else f"{'-':>5}"
            same = sum(a == b for a, b in zip(result.token_ids, eager_tokens))
            print(f"{batch_size:>5} | {name:<11} | {e2e:9.1f} {decode:9.1f} | {step} | {ratio} | {same}/{batch_size}",
                  flush=True)


def _time_call(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats, timed by CUDA events (host clock on CPU)."""
    fn()
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _attention_rows(args: argparse.Namespace) -> None:
    from workers.kernels import torch_ref, triton_attention

    heads, kv_heads, head_dim, block = 9, 3, 64, 16
    dtype, device = getattr(torch, args.dtype), args.device
    cases = [(f"decode {batch}", [(args.context, 1)] * batch) for batch in map(int, args.attention_batches.split(","))]
    cases.append((f"prefill {args.prefill_len}", [(0, args.prefill_len)]))
    header = f"{'attention':<12} | {'triton ms':>9} | {'torch_ref ms':>12} | {'speedup':>7} | max abs diff"
    print(header + "\n" + "-" * len(header), flush=True)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for name, specs in cases:
        seq_lens = [context + queries for context, queries in specs]
        pages = [-(-n // block) for n in seq_lens]
        num_blocks = sum(pages) + 1
        k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(device, dtype)
        v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen).to(device, dtype)
        order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # scattered pages, block 0 unused
        table = torch.zeros(len(specs), max(pages), dtype=torch.int32)
        offset = 0
        for row, count in enumerate(pages):
            table[row, :count] = torch.tensor(order[offset:offset + count], dtype=torch.int32)
            offset += count
        query_lens = [queries for _, queries in specs]
        query_start = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(device, dtype)
        call_args = (q, k_cache, v_cache, table.to(device), query_start.to(device),
                     torch.tensor(seq_lens, dtype=torch.int32, device=device), head_dim ** -0.5)
        triton_s = _time_call(lambda: triton_attention.paged_attention(*call_args), args.attention_repeats)
        ref_s = _time_call(lambda: torch_ref.paged_attention(*call_args), args.attention_repeats)
        diff = (triton_attention.paged_attention(*call_args).float() - torch_ref.paged_attention(*call_args).float())
        print(f"{name:<12} | {triton_s * 1e3:9.3f} | {ref_s * 1e3:12.3f} | {ref_s / triton_s:6.1f}x | "
              f"{diff.abs().max().item():.3g}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local HF directory (default: random weights in --shape)")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES),
                        help="the architecture of the random weights when --model is not given")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--attention-backend", default="triton", choices=("triton", "torch", "cpu"))
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-runner", action="store_true")
    parser.add_argument("--context", type=int, default=1024, help="keys per sequence in the decode attention rows")
    parser.add_argument("--attention-batches", default="64,256", help="decode batch sizes of the attention rows")
    parser.add_argument("--prefill-len", type=int, default=4096, help="tokens of the prefill attention row")
    parser.add_argument("--attention-repeats", type=int, default=20)
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(args.device)
        print(f"{props.name}, {props.multi_processor_count} SMs | torch {torch.__version__} | "
              f"{args.dtype} | prompt {args.prompt_len} | new tokens {args.new_tokens}", flush=True)
    if not args.skip_runner:
        with tempfile.TemporaryDirectory() as scratch:
            model_dir = Path(args.model) if args.model else Path(scratch) / f"{args.shape}-random"
            if not args.model:
                started = time.perf_counter()
                write_random_model(model_dir, SHAPES[args.shape])
                print(f"random {args.shape} weights written in {time.perf_counter() - started:.1f} s", flush=True)
            _decode_rows(args, model_dir, [int(size) for size in args.batch_sizes.split(",")])
    if not args.skip_attention:
        _attention_rows(args)


if __name__ == "__main__":
    main()
