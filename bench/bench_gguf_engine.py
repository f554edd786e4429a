"""The default model served quantized (its GGUF weights as they ship) against dequantized fp32,
in-process (engine + model runner, no HTTP), the sides alternating round by round.

    .venv/bin/python -m bench.bench_gguf_engine                       # c1 and c16, 3 rounds
    .venv/bin/python -m bench.bench_gguf_engine --concurrency 16 --rounds 2 --threads 2

Sides: "dense fp32" (quantization none: the converted safetensors), "gguf int8" (quantization
auto: the GGUF kernels with activations rounded to int8 per 32-block, the default mode) and
"gguf fp32x" (the same weights, activations kept in fp32 inside the kernels). Each round sends
`concurrency` random prompts of --prompt-len tokens at once and generates --new-tokens greedy
tokens each (ignore_eos); it prints output tokens per second per side and round. The machine is
shared: read the ratios within a round.
"""

from __future__ import annotations

import argparse
import random
import time

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.sampling_params import SamplingParams


def engine_for(quantization: str, threads: int) -> Engine:
    from workers.model_runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(dtype="auto" if quantization == "auto" else "float32",
                                      quantization=quantization, num_threads=threads, num_blocks=2048))
    info = runner.model_info
    config = SchedulerConfig(block_size=info.block_size, num_blocks=info.num_blocks, max_model_len=info.max_model_len,
                             max_num_batched_tokens=2048, max_num_seqs=64)
    return Engine(config, runner, info.eos_token_ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16", help="comma-separated stream counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from workers.kernels import gguf

    dense, quantized = engine_for("none", args.threads), engine_for("auto", args.threads)
    sides = [("dense fp32", dense, None), ("gguf int8", quantized, "int8"), ("gguf fp32x", quantized, "fp32")]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rng = random.Random(0)
    default_mode = gguf.DEFAULT_MODE
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for round_index in range(args.rounds):
            for name, engine, mode in sides:
                gguf.DEFAULT_MODE = mode or default_mode
                prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(concurrency)]
                started = time.perf_counter()
                engine.generate(prompts, params)
                elapsed = time.perf_counter() - started
                print(f"c{concurrency} round {round_index} {name:11s}: "
                      f"{concurrency * args.new_tokens / elapsed:7.1f} out tok/s ({elapsed:.2f} s)", flush=True)
    gguf.DEFAULT_MODE = default_mode


if __name__ == "__main__":
    main()
