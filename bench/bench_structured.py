"""Structured outputs: c16 output tok/s with a JSON schema on every request vs unconstrained, same run.

    flock /tmp/rayllm-heavy.lock .venv/bin/python -m bench.bench_structured            # 2 rounds
    flock /tmp/rayllm-heavy.lock .venv/bin/python -m bench.bench_structured --rounds 3 --num-prompts 48

1. HTTP (what users run): a local Ray and our app with the shipped deploy settings (2 workers x
   1 torch thread, 512-token steps; prefix caching off so neither side warms the other's
   cache), driven by bench/serving_client.py: --num-prompts random chat prompts of
   --input-len tokens, --output-len tokens each, greedy, streaming, 16 in flight.
   - unconstrained: ignore_eos, so every request generates exactly --output-len tokens;
   - constrained: response_format json_schema on every request, a schema whose shortest
     document is longer than --output-len tokens (an array of at least 64 short strings),
     so every request also generates exactly --output-len tokens and ends with "length";
     every token is masked, strings included (the lexer's most expensive state).
   Both sides send the same prompts in a round; the side that goes first alternates.
   Reported per run: output tok/s, TPOT p50, ITL p99; and the ratio constrained /
   unconstrained per round (target >= 0.9: at most 10% slower).
2. In-process mask cost per step: the real ModelRunner (1 thread) under the real scheduler,
   16 constrained requests at once, reading the runner's grammar counters: bitmask fill per
   step (16 rows), token accepts per step, plus what the mask adds to the sampler for 16
   rows (timed alone: the sampler with the bitmask minus without), against the mean step
   time of the same run.

The load average is printed with every run: this machine is shared.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from bench import datasets  # noqa: E402
from bench.bench_http import load_avg  # noqa: E402
from bench.metrics import calculate_metrics  # noqa: E402
from bench.served_app import serve_here  # noqa: E402
from bench.serving_client import RunConfig, fetch_models, run_requests  # noqa: E402

LONG_SCHEMA = {  # shortest document: 64 strings of at least 2 characters, well over 128 tokens
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string", "minLength": 2, "maxLength": 12},
                             "minItems": 64}},
    "required": ["words"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "words", "schema": LONG_SCHEMA}}
APP_NAME = "rayllm-bench-structured"
SHIPPED_APP_ARGS = {"num_workers": "auto", "max_num_batched_tokens": 512, "enable_prefix_caching": False}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="local HF model dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (unconstrained, constrained)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--ray-num-cpus", type=int, default=4, help="logical CPUs of the local Ray")
    parser.add_argument("--skip-http", action="store_true", help="only the in-process mask cost")
    return parser.parse_args()


def run_side(base_url: str, model: str, requests, args, constrained: bool, seed: int) -> dict:
    cfg = RunConfig(base_url=base_url, model=model, chat=True, ignore_eos=not constrained, temperature=0.0,
                    max_concurrency=args.max_concurrency, seed=seed, disable_tqdm=True,
                    extra_body={"response_format": RESPONSE_FORMAT} if constrained else {})
    load = load_avg()
    results, duration = asyncio.run(run_requests(cfg, requests))
    metrics = calculate_metrics(results, duration, [50.0, 99.0])
    lengths = sorted({r.output_tokens for r in results if r.success})
    return {"side": "constrained" if constrained else "unconstrained", "output_tok_s": metrics["output_throughput"],
            "tpot_p50_ms": metrics.get("p50_tpot_ms"), "itl_p99_ms": metrics.get("p99_itl_ms"),
            "failed": metrics["failed"], "output_lengths": lengths, "load_avg": load}


def http_phase(args: argparse.Namespace) -> list[dict]:
    tokenizer = datasets.PromptTokenizer(_tokenizer_path(args.model))
    runs = []
    app_args = {**SHIPPED_APP_ARGS, "name": APP_NAME} | ({"model": args.model} if args.model else {})
    with serve_here(app_args, name=APP_NAME, port=args.port, num_cpus=args.ray_num_cpus) as base_url:
        model = asyncio.run(fetch_models(base_url))[0]["id"]
        for round_index in range(args.rounds):
            requests = datasets.random_requests(tokenizer, num_prompts=args.num_prompts, input_len=args.input_len,
                                                output_len=args.output_len, seed=round_index)
            order = (False, True) if round_index % 2 == 0 else (True, False)
            pair = {}
            for constrained in order:
                run = run_side(base_url, model, requests, args, constrained, round_index)
                run["round"] = round_index
                runs.append(run)
                pair[constrained] = run
                print(json.dumps(run), flush=True)
            ratio = pair[True]["output_tok_s"] / pair[False]["output_tok_s"]
            print(f"round {round_index}: constrained / unconstrained output tok/s = {ratio:.3f}", flush=True)
    return runs


def _tokenizer_path(model: str | None) -> str:
    from workers.loader import resolve_model_path

    return str(resolve_model_path(model) / "tokenizer.json")


def mask_phase(args: argparse.Namespace) -> dict:
    """Grammar cost per step inside the real runner, 16 constrained requests at once."""
    import torch

    from scheduler.config import SchedulerConfig
    from scheduler.engine import Engine
    from scheduler.sampling_params import GrammarSpec, SamplingParams
    from workers.model_runner import ModelRunner, RunnerConfig
    from workers.kernels.sampling import AllowedTokens, RowParams, sample_rows

    runner = ModelRunner(RunnerConfig(model=args.model, num_threads=1, kv_cache_memory_bytes=256 << 20))
    info = runner.model_info
    engine = Engine(SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, block_size=info.block_size,
                                    num_blocks=info.num_blocks, max_model_len=1024, enable_prefix_caching=False),
                    runner, eos_token_ids=info.eos_token_ids)
    spec = GrammarSpec("json_schema", json.dumps(LONG_SCHEMA))
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, info.vocab_size, (args.max_concurrency, args.input_len), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, grammar=spec)
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, grammar=spec))  # tokenizer, compile
    before = dataclass_copy(runner.grammars.timing)
    steps_before, load = engine.stats.num_steps, load_avg()
    started = time.perf_counter()
    engine.generate(prompts, params)
    wall_s = time.perf_counter() - started
    timing = runner.grammars.timing
    num_steps = engine.stats.num_steps - steps_before
    mask_steps = timing.num_mask_steps - before.num_mask_steps
    logits = torch.randn(args.max_concurrency, info.vocab_size)
    bitmask = torch.full((args.max_concurrency, (info.vocab_size + 31) // 32), 0x0F0F0F0F, dtype=torch.int32)
    allowed = AllowedTokens(torch.arange(args.max_concurrency), bitmask)
    rows = RowParams.of(*([[0.0] * args.max_concurrency] * 5))  # greedy rows, as in the generate above
    masked_s = _median_time(lambda: sample_rows(logits, rows, allowed=allowed), 50)
    apply_s = max(0.0, masked_s - _median_time(lambda: sample_rows(logits, rows), 50))
    result = {
        "steps": num_steps, "mean_step_ms": 1e3 * wall_s / num_steps,
        "rows_per_mask_step": (timing.num_mask_rows - before.num_mask_rows) / mask_steps,
        "fill_ms_per_step": 1e3 * (timing.mask_s - before.mask_s) / mask_steps,
        "accept_ms_per_step": 1e3 * (timing.accept_s - before.accept_s) / mask_steps,
        "apply_ms_per_step": 1e3 * apply_s, "load_avg": load,
    }
    total = result["fill_ms_per_step"] + result["accept_ms_per_step"] + result["apply_ms_per_step"]
    result["mask_ms_per_step"] = total
    result["mask_share_of_step"] = total / result["mean_step_ms"]
    return result


def dataclass_copy(value):
    import dataclasses

    return dataclasses.replace(value)


def _median_time(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    runs = [] if args.skip_http else http_phase(args)
    mask = mask_phase(args)
    print(json.dumps({"mask_per_step": mask}), flush=True)
    for round_index in range(args.rounds if runs else 0):
        by_side = {run["side"]: run for run in runs if run["round"] == round_index}
        print(f"round {round_index}: unconstrained {by_side['unconstrained']['output_tok_s']:.1f} tok/s, "
              f"constrained {by_side['constrained']['output_tok_s']:.1f} tok/s, ratio "
              f"{by_side['constrained']['output_tok_s'] / by_side['unconstrained']['output_tok_s']:.3f} "
              f"(load {by_side['unconstrained']['load_avg']} / {by_side['constrained']['load_avg']})")
    print(f"mask per step (16 rows): fill {mask['fill_ms_per_step']:.2f} ms + accept {mask['accept_ms_per_step']:.2f}"
          f" ms + apply {mask['apply_ms_per_step']:.2f} ms = {mask['mask_ms_per_step']:.2f} ms of a "
          f"{mask['mean_step_ms']:.1f} ms step ({100 * mask['mask_share_of_step']:.1f}%)")


if __name__ == "__main__":
    main()
