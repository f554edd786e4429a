"""Decode throughput of our ModelRunner vs Hugging Face generate, same model, same run.

    .venv/bin/python -m bench.bench_runner                      # SmolLM2, batch 1 8 16, prompt 128, 128 new
    .venv/bin/python -m bench.bench_runner --batch-sizes 16 --repeats 3 --threads 1
    .venv/bin/python -m bench.bench_runner --breakdown          # step vs GEMM-only vs attention (bench/step_breakdown.py)
    .venv/bin/python -m bench.bench_runner --breakdown --quantization auto   # the GGUF weights, as served
    .venv/bin/python -m bench.bench_runner --sampling           # sampled vs greedy decode steps (bench/sampling_cost.py)

Both sides run greedy on the same random prompts (prompt_len tokens each, no padding) for
exactly new_tokens tokens (EOS ignored), fp32 on CPU with the same torch thread count.
Reported per batch size (best of --repeats):

- end-to-end generated tokens/s (prefill included) and decode tokens/s (prefill excluded:
  HF's prefill is timed by a separate max_new_tokens=1 call, ours is the first step);
  the two sides alternate run by run, and each side's fastest run counts;
- the ratio ours / HF;
- for our runner, where a decode step's time goes: the model forward (+ lm_head), and
  everything else inside ModelRunner.execute (input preparation and sampling) as the
  runner's own overhead fraction, plus the SimpleDriver's scheduling time around it.

Set OMP_WAIT_POLICY=PASSIVE (done here when unset) so spinning OpenMP threads do not fight
other processes; the load average is printed before and after, since a busy machine slows
torch down several times.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from scheduler.sampling_params import SamplingParams  # noqa: E402
from workers.loader import resolve_model_path  # noqa: E402
from workers.model_runner import ModelRunner, RunnerConfig  # noqa: E402
from workers.simple_driver import SimpleDriver  # noqa: E402

DEFAULT_DTYPES = "float32,bfloat16"  # --dtypes


@dataclass
class RunResult:
    total_s: float  # prefill + decode, wall
    prefill_s: float  # the prefill part
    token_ids: list[list[int]]  # generated tokens per sequence


@dataclass
class StepBreakdown:
    step_s: float  # median decode step, wall (driver + runner)
    execute_s: float  # median ModelRunner.execute
    forward_s: float  # median model forward + lm_head
    prepare_s: float  # median input preparation
    sample_s: float  # median sampling


def make_prompts(batch_size: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch_size, prompt_len), generator=generator).tolist()


def run_hf(model, prompts: list[list[int]], new_tokens: int) -> RunResult:
    input_ids = torch.tensor(prompts, device=model.device)
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(input_ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        output = model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total_s = time.perf_counter() - started
    return RunResult(total_s, prefill_s, output[:, input_ids.shape[1]:].tolist())


def run_ours(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[RunResult, StepBreakdown]:
    driver = SimpleDriver(runner, token_budget=max(2048, sum(len(p) for p in prompts)))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        driver.add_request(f"bench-{index}", prompt, params)
    steps, timings = [], []
    started = time.perf_counter()
    driver.step()  # the whole batch's prefill (the budget holds it) and the first token
    prefill_s = time.perf_counter() - started
    while driver.has_unfinished:
        step_started = time.perf_counter()
        driver.step()
        steps.append(time.perf_counter() - step_started)
        timings.append(runner.last_timing)
    total_s = time.perf_counter() - started
    requests = [driver.requests[f"bench-{index}"] for index in range(len(prompts))]
    breakdown = StepBreakdown(
        step_s=statistics.median(steps),
        execute_s=statistics.median(t.total_s for t in timings),
        forward_s=statistics.median(t.forward_s for t in timings),
        prepare_s=statistics.median(t.prepare_s for t in timings),
        sample_s=statistics.median(t.sample_s for t in timings),
    )
    return RunResult(total_s, prefill_s, [r.output_token_ids for r in requests]), breakdown


def tokens_per_s(result: RunResult, batch_size: int, new_tokens: int) -> tuple[float, float]:
    end_to_end = batch_size * new_tokens / result.total_s
    decode = batch_size * (new_tokens - 1) / max(result.total_s - result.prefill_s, 1e-9)
    return end_to_end, decode


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs per side and batch size; the best counts")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="weights and activations, both sides (bfloat16 is fast only on CPUs with AVX512-BF16/AMX)")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead: decode step time vs its GEMM-only time, attention share and weight-read time "
                             "(bench/step_breakdown.py), at --batch-sizes (default here 1,16) and --prompt-len (256)")
    parser.add_argument("--dtypes", default=DEFAULT_DTYPES,
                        help="--breakdown: dtypes to run (default float32,bfloat16; with --quantization auto: auto, "
                             "the path a GGUF model is served on, fp32 activations over an fp16 KV pool)")
    parser.add_argument("--threads-list", default="1,2", help="--breakdown: torch thread counts to run")
    parser.add_argument("--sampling", action="store_true",
                        help="instead: greedy vs sampled (temperature 1.0, top_p 0.95) decode steps side by side "
                             "(bench/sampling_cost.py), at --batch-sizes (default here 1,16), --threads, --dtypes "
                             "(default here auto) and --prompt-len (256)")
    parser.add_argument("--quantization", default="none", choices=["none", "auto"],
                        help="--breakdown: auto serves a GGUF model (the default's Q4_1 file, a .gguf path) with its "
                             "quantized weights; the weight-read time is then that of their blocks")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="--breakdown: the KV pool's dtype (auto: fp16 under auto fp32 activations on CPU)")
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="--breakdown: also a step computing N prompts of --prompt-len tokens (8: the 2048-token "
                             "steps of a c16 wave), against its GEMM-only time")
    return parser.parse_args()


def breakdown_dtypes(dtypes: str, quantization: str) -> list[str]:
    """The breakdown's dtypes: those asked for; left at the default with a GGUF model, auto alone, as
    it is served (an explicit float32 would run its dequantized weights, bfloat16 its bf16 path)."""
    return ["auto"] if dtypes == DEFAULT_DTYPES and quantization == "auto" else dtypes.split(",")


def run_breakdown(args: argparse.Namespace) -> None:
    from bench import step_breakdown

    batches = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes != "1,8,16" else [1, 16]
    prompt_len = args.prompt_len if args.prompt_len != 128 else 256
    print(f"model {resolve_model_path(args.model)} | context {prompt_len} | OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')} | load average before {os.getloadavg()[0]:.2f}")
    print(step_breakdown.HEADER)
    print("-" * len(step_breakdown.HEADER))
    model = str(resolve_model_path(args.model)) if args.quantization == "none" else (args.model or "default")
    threads = [int(t) for t in args.threads_list.split(",")]
    step_breakdown.run(model, breakdown_dtypes(args.dtypes, args.quantization), threads, batches, prompt_len,
                       prefill_seqs=args.prefill, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    print(f"load average after {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")


def run_sampling(args: argparse.Namespace) -> None:
    from bench import sampling_cost

    batches = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes != "1,8,16" else [1, 16]
    dtypes = args.dtypes.split(",") if args.dtypes != DEFAULT_DTYPES else ["auto"]
    prompt_len = args.prompt_len if args.prompt_len != 128 else 256
    print(f"model {resolve_model_path(args.model)} | context {prompt_len} | sampled: temperature 1.0, top_p 0.95 | "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} | load average before {os.getloadavg()[0]:.2f}")
    print(sampling_cost.HEADER)
    print("-" * len(sampling_cost.HEADER))
    sampling_cost.run(str(resolve_model_path(args.model)), dtypes, args.threads, batches, prompt_len,
                      rounds=max(args.repeats, 3))
    print(f"load average after {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")


def main() -> None:
    args = parse_args()
    if args.breakdown:
        run_breakdown(args)
        return
    if args.sampling:
        run_sampling(args)
        return
    torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model_dir = resolve_model_path(args.model)
    block_size = 16
    blocks_per_seq = -(-(args.prompt_len + args.new_tokens) // block_size)
    runner = ModelRunner(RunnerConfig(model=str(model_dir), dtype=args.dtype, block_size=block_size,
                                      num_blocks=max(batch_sizes) * blocks_per_seq + 1, num_threads=args.threads))
    hf_model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype)).eval()
    print(f"model {model_dir} | {args.dtype} | prompt {args.prompt_len} | new tokens {args.new_tokens} | torch threads "
          f"{torch.get_num_threads()} | OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} | "
          f"load average before {os.getloadavg()[0]:.2f}")
    warm = make_prompts(2, 16, runner.model_info.vocab_size, seed=99)
    run_ours(runner, warm, 4)
    if hf_model is not None:
        run_hf(hf_model, warm, 4)
    header = (f"{'batch':>5} | {'ours tok/s':>10} {'decode':>7} | {'HF tok/s':>9} {'decode':>7} | "
              f"{'ratio':>5} {'decode':>6} | same tokens | step ms: wall execute forward | runner overhead")
    print(header)
    print("-" * len(header))
    for batch_size in batch_sizes:
        prompts = make_prompts(batch_size, args.prompt_len, runner.model_info.vocab_size)
        ours_runs, hf_runs = [], []
        for _ in range(args.repeats):  # alternate the sides, so both see the same machine load
            ours_runs.append(run_ours(runner, prompts, args.new_tokens))
            if hf_model is not None:
                hf_runs.append(run_hf(hf_model, prompts, args.new_tokens))
        ours, breakdown = min(ours_runs, key=lambda pair: pair[0].total_s)
        ours_e2e, ours_decode = tokens_per_s(ours, batch_size, args.new_tokens)
        hf_cells, same = f"{'-':>9} {'-':>7}", "-"
        ratio_cells = f"{'-':>5} {'-':>6}"
        if hf_runs:
            hf = min(hf_runs, key=lambda result: result.total_s)
            hf_e2e, hf_decode = tokens_per_s(hf, batch_size, args.new_tokens)
            hf_cells = f"{hf_e2e:9.1f} {hf_decode:7.1f}"
            ratio_cells = f"{ours_e2e / hf_e2e:5.2f} {ours_decode / hf_decode:6.2f}"
            same = f"{sum(a == b for a, b in zip(ours.token_ids, hf.token_ids))}/{batch_size}"
        overhead = (breakdown.execute_s - breakdown.forward_s) / breakdown.execute_s
        print(f"{batch_size:>5} | {ours_e2e:10.1f} {ours_decode:7.1f} | {hf_cells} | {ratio_cells} | {same:>11} | "
              f"{breakdown.step_s * 1e3:8.1f} {breakdown.execute_s * 1e3:7.1f} {breakdown.forward_s * 1e3:7.1f} | "
              f"{overhead:6.1%} (prepare {breakdown.prepare_s * 1e3:.2f} ms, sample {breakdown.sample_s * 1e3:.2f} ms, "
              f"driver {(breakdown.step_s - breakdown.execute_s) * 1e3:.2f} ms)")
    print(f"load average after {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")


if __name__ == "__main__":
    main()
