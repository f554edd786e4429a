"""A hybrid model's steps against a dense model of the same shape, in-process, side by side.

    python -m bench.bench_hybrid [--family lfm2] [--streams 16] [--rounds 5]

Builds two random checkpoints with transformers' own classes (once, under --workdir): the hybrid
family at its published small model's shapes (lfm2: LFM2-350M, 10 short-convolution layers and 6
attention layers; granitemoehybrid: Granite 4.0-H's mix of Mamba-2 and attention layers at that width;
qwen3_5_text: Qwen3.5's mix of Gated DeltaNet and attention layers at that width), and a llama of the same
width, depth, heads and MLP, whose every layer attends.
Then, alternating between the two for --rounds rounds, it reports:

- decode: the median seconds of a decode step of --streams sequences (every row a decode), after
  prompts of --prompt-len tokens; the hybrid's over the dense one's is the issue's 1.2x budget;
- a prefix hit: the seconds to a repeated --hit-len-token prompt's first token, cold and then
  hit (the hybrid restores its recurrent states from a snapshot), through the real scheduler;
- bytes: the KV pool's bytes per token, and the hybrid's state bytes per sequence.

Both run on the default CPU path for their family (the dense one on our C layer loop, the
hybrid on the Python loop over our products and attention kernels: /v1/models says which); the
dense model on the Python loop is a third column, to tell the loop's cost from the layers'.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tiny_model: the checkpoint builder

from bench.bench_lora import decode_steps  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402
from workers.model_runner import ModelRunner, RunnerConfig, kv_bytes_per_token  # noqa: E402

# the published small model of each hybrid family, as transformers config overrides
HYBRID_SHAPES = {
    "lfm2": dict(model_type="lfm2", vocab_size=65536, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=8, block_ff_dim=6656, block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                 max_position_embeddings=4096, conv_L_cache=3,
                 layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "conv",
                              "full_attention", "conv", "full_attention", "conv", "full_attention", "conv",
                              "full_attention", "conv"]),
    # Granite 4.0-H's layer mix (an attention layer every tenth, Mamba-2 elsewhere) at LFM2-350M's width
    "granitemoehybrid": dict(model_type="granitemoehybrid", vocab_size=65536, hidden_size=1024, num_hidden_layers=20,
                             num_attention_heads=16, num_key_value_heads=4, num_local_experts=0,
                             shared_intermediate_size=4096, max_position_embeddings=4096,
                             layer_types=["attention" if layer % 10 == 9 else "mamba" for layer in range(20)],
                             mamba_n_heads=32, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
                             mamba_expand=2, mamba_chunk_size=256),
    # Qwen3.5's dense layer mix (Gated DeltaNet in three of four layers) at the same width
    "qwen3_5_text": dict(model_type="qwen3_5_text", vocab_size=65536, hidden_size=1024, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, intermediate_size=3584,
                         max_position_embeddings=4096,
                         layer_types=["full_attention" if layer % 4 == 3 else "linear_attention"
                                      for layer in range(24)],
                         linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                         linear_value_head_dim=128, linear_conv_kernel_dim=4),
}


def dense_of(shapes: dict, runner: ModelRunner) -> dict:
    """A llama with the hybrid's width, depth, heads and MLP width (as the hybrid's config resolved it)."""
    c = runner.model_config
    return dict(model_type="llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, intermediate_size=c.intermediate_size,
                max_position_embeddings=shapes["max_position_embeddings"], tie_word_embeddings=c.tie_word_embeddings)


def checkpoint(root: Path, name: str, overrides: dict) -> Path:
    from tiny_model import build_tiny_model_dir

    model_dir = root / name
    if not (model_dir / "config.json").is_file():
        print(f"building {model_dir} ...", flush=True)
        build_tiny_model_dir(model_dir, init_std=0.02, **overrides)
    return model_dir


def parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as checkpoint:
        return sum(torch.Size(checkpoint.get_slice(name).get_shape()).numel() for name in checkpoint.keys())


def make_runner(model_dir: Path, args: argparse.Namespace) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=str(model_dir), dtype=args.dtype, num_threads=args.threads, block_size=16,
                                    num_blocks=1024, max_num_seqs=args.streams, state_snapshots=8))


def time_to_first_token(runner: ModelRunner, prompt: list[int]) -> tuple[float, float]:
    """Seconds to the first token of the prompt, cold and then again (a prefix hit)."""
    info = runner.model_info
    engine = Engine(SchedulerConfig(block_size=16, num_blocks=info.num_blocks, max_model_len=info.max_model_len,
                                    max_num_batched_tokens=2048, recurrent_state=info.has_recurrent_state,
                                    num_state_snapshots=info.num_state_snapshots), runner, eos_token_ids=())
    try:
        times = []
        for index in range(2):
            started = time.perf_counter()
            engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
            times.append(time.perf_counter() - started)
        return times[0], times[1]
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="lfm2", choices=sorted(HYBRID_SHAPES))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hit-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "rayllm" / "bench-hybrid"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.workdir)
    shapes = HYBRID_SHAPES[args.family]
    hybrid = make_runner(checkpoint(root, args.family, shapes), args)
    dense = make_runner(checkpoint(root, f"{args.family}-dense-llama", dense_of(shapes, hybrid)), args)
    dense_python = make_runner(Path(dense.model_path), args)
    dense_python.model.native_forward = None  # the same dense model on the Python loop the hybrid takes
    runners = {"hybrid": hybrid, "dense": dense, "dense on the Python loop": dense_python}
    for name, runner in runners.items():
        info = runner.model_info
        kv = kv_bytes_per_token(runner.model_config, getattr(torch, info.kv_cache_dtype))
        print(f"{name}: {info.model_type}, {parameters(Path(info.model_path)) / 1e6:.1f}M parameters, dtype {info.dtype}, "
              f"layer loop {info.layer_loop}, KV {kv} bytes per token; {info.kv_cache_kind}", flush=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60000, (args.prompt_len,), generator=generator).tolist() for _ in range(args.streams)]
    hit_prompt = torch.randint(3, 60000, (args.hit_len,), generator=generator).tolist()
    steps = {name: [] for name in runners}
    first = {name: [] for name in runners}
    for round_index in range(args.rounds):
        for name, runner in runners.items():
            step = statistics.median(decode_steps(runner, prompts, [None] * args.streams, args.new_tokens))
            cold, hit = time_to_first_token(runner, hit_prompt[round_index:] + hit_prompt[:round_index])
            steps[name].append(step)
            first[name].append((cold, hit))
            print(f"round {round_index + 1} {name}: decode step {step * 1e3:.2f} ms; first token cold {cold * 1e3:.0f} "
                  f"ms, hit {hit * 1e3:.0f} ms", flush=True)
    for baseline in ("dense", "dense on the Python loop"):
        ratios = [h / d for h, d in zip(steps["hybrid"], steps[baseline])]
        print(f"decode step, batch {args.streams}: hybrid / {baseline} per round "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x")
    for name in runners:
        cold = statistics.median(c for c, _ in first[name])
        hit = statistics.median(h for _, h in first[name])
        print(f"{name}: first token of {args.hit_len} tokens, median cold {cold * 1e3:.0f} ms, hit {hit * 1e3:.0f} ms "
              f"({cold / hit:.1f}x faster)")


if __name__ == "__main__":
    main()
