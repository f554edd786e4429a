"""The in-process engine vs Hugging Face generate, and n=8 forking vs 8 requests.

    .venv/bin/python -m bench.bench_engine                       # SmolLM2, both parts, 1 repeat
    .venv/bin/python -m bench.bench_engine --repeats 2 --parts throughput

Part "throughput": `--num-requests` prompts of seeded random token ids, lengths uniform in
[`--min-prompt-len`, `--max-prompt-len`], each generating exactly `--output-len` tokens
(greedy, EOS ignored).
- ours: every request submitted to one fresh Engine at once (continuous batching, chunked
  prefill under `--max-num-batched-tokens`, a KV pool that holds them all by default);
- HF: `model.generate` on the same requests in submission order, static batches of
  `--hf-batch-size`, left-padded with an attention mask; a batch ends when all its rows have
  `--output-len` tokens (no row finishes early with EOS ignored, so no decode is wasted
  on finished rows: the static batch's cost here is the padding and the batch boundary).
The sides alternate run by run; output tokens/s of each run, the best of each side, and the
ratio ours / HF (target >= 3x). Also: how many of the greedy sequences are identical, and
where our run's time went (steps that computed prompt tokens vs decode-only steps, median
decode step), from a StatsSink on the engine.

Part "fork": one `--fork-prompt-len`-token prompt, `--fork-output-len` tokens per sequence,
sampled (temperature `--fork-temperature`, seeded, EOS ignored), as
- n=8: one request with n=8 (children seeded seed+i, as SamplingParams.for_child does);
- 8 separate requests (seeds seed+i) submitted at once, prefix caching OFF: the fair
  baseline of the same work without forking (each computes the prompt);
- the same with prefix caching ON, submitted at once: the scheduler admits all 8 in one step,
  before any block is cached, so each still computes the prompt;
- the same with prefix caching ON, staggered: the first request alone until its first token,
  then the other 7 (they hit the cached prompt blocks): what a vLLM user with prefix
  caching sees when the copies arrive apart.
Per variant: prompt tokens computed (the engine's CumulativeStats), prefix-hit tokens, wall
time, and n=8's wall time over the variant's (target: prompt computed once, <= 0.6x the
baseline). Each variant runs on a fresh Engine (empty prefix cache) over the same runner.

OMP_WAIT_POLICY=PASSIVE is set when unset (before torch loads OpenMP), `--threads` torch
threads for both sides; the load average is printed before and after, since a busy
2-core machine slows torch down several times.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.outputs import EngineRequest  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

MIN_TOKEN_ID = 100  # random prompts skip the low ids, where the special tokens live


@dataclass(slots=True)
class EngineRun:
    wall_s: float  # first add_request -> last final delta
    token_ids: list[list[int]]  # generated, per sequence (request order, then child index)
    num_prompt_tokens_computed: int  # from the engine's CumulativeStats
    num_prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


@dataclass(slots=True)
class ThroughputRun:
    side: str  # "ours" | "hf"
    wall_s: float
    num_output_tokens: int
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


def load_avg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def make_prompts(num: int, low: int, high: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(low, high) for _ in range(num)]
    return [[rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)] for n in lengths]


# --- ours ---------------------------------------------------------------------------------------
async def run_engine(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], tag: str,
                     stagger_first: bool = False) -> EngineRun:
    """Submits the requests (all at once, or the first alone until its first token) and
    waits for all; the stats are the engine's counters over this run."""
    before = engine.stats
    sequences: dict[tuple[int, int], list[int]] = {}
    first_token = asyncio.Event()

    async def consume(index: int, stream) -> None:
        async for delta in stream:
            sequences.setdefault((index, delta.index), []).extend(delta.new_token_ids)
            if delta.new_token_ids:
                first_token.set()

    started = time.perf_counter()
    tasks = []
    for index, (prompt, sp) in enumerate(zip(prompts, params)):
        stream = engine.add_request(EngineRequest(f"{tag}-{index}", prompt, sp))
        tasks.append(asyncio.create_task(consume(index, stream)))
        if stagger_first and index == 0:
            await first_token.wait()
    await asyncio.gather(*tasks)
    wall_s = time.perf_counter() - started
    after = engine.stats
    return EngineRun(
        wall_s=wall_s,
        token_ids=[sequences[key] for key in sorted(sequences)],
        num_prompt_tokens_computed=after.num_prompt_tokens_computed - before.num_prompt_tokens_computed,
        num_prefix_hit_tokens=after.num_prefix_hit_tokens - before.num_prefix_hit_tokens,
        num_preemptions=after.num_preemptions - before.num_preemptions,
        num_steps=after.num_steps - before.num_steps,
    )


class StepRecorder:
    """A StatsSink keeping (prompt tokens, sequences, seconds) per step: where the time goes."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, float]] = []

    def on_step(self, worker, step, duration_s: float, inter_token_latencies_s) -> None:
        self.steps.append((step.num_prompt_tokens_computed, step.num_scheduled_seqs, duration_s))

    def on_request_finished(self, request) -> None:
        pass

    def summary(self) -> dict:
        prefill = [s for s in self.steps if s[0] > 0]
        decode = sorted(s[2] for s in self.steps if s[0] == 0)
        return {
            "steps_with_prompt_tokens": len(prefill),
            "seconds_in_steps_with_prompt_tokens": round(sum(s[2] for s in prefill), 2),
            "decode_only_steps": len(decode),
            "seconds_in_decode_only_steps": round(sum(decode), 2),
            "median_decode_step_ms": round(1e3 * decode[len(decode) // 2], 1) if decode else None,
            "max_decode_batch": max((s[1] for s in self.steps if s[0] == 0), default=0),
        }


def fresh_engine(runner, args: argparse.Namespace, prefix_caching: bool = True,
                 recorder: StepRecorder | None = None) -> Engine:
    info = runner.model_info
    config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        block_size=info.block_size, num_blocks=info.num_blocks, max_model_len=info.max_model_len,
        enable_prefix_caching=prefix_caching,
    )
    return Engine(config, runner, eos_token_ids=info.eos_token_ids, stats_sink=recorder)


def engine_throughput(runner, args, prompts: list[list[int]], tag: str) -> tuple[ThroughputRun, list[list[int]]]:
    recorder = StepRecorder()
    engine = fresh_engine(runner, args, recorder=recorder)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    try:
        run = asyncio.run(run_engine(engine, prompts, [params] * len(prompts), tag))
    finally:
        engine.close()
    extra = {"steps": run.num_steps, "preemptions": run.num_preemptions,
             "prompt_tokens_computed": run.num_prompt_tokens_computed} | recorder.summary()
    return ThroughputRun("ours", run.wall_s, run.num_output_tokens, extra), run.token_ids


# --- Hugging Face ---------------------------------------------------------------------------------
def hf_throughput(model, args, prompts: list[list[int]], pad_id: int) -> tuple[ThroughputRun, list[list[int]]]:
    import torch

    outputs: list[list[int]] = []
    padded_tokens = 0
    started = time.perf_counter()
    for start in range(0, len(prompts), args.hf_batch_size):
        batch = prompts[start:start + args.hf_batch_size]
        width = max(len(p) for p in batch)
        padded_tokens += sum(width - len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            generated = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=args.output_len,
                min_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=pad_id,
            )
        new = generated[:, width:]
        assert new.shape[1] == args.output_len, new.shape
        outputs.extend(new.tolist())
    wall_s = time.perf_counter() - started
    extra = {"padding_tokens": padded_tokens}
    return ThroughputRun("hf", wall_s, sum(len(o) for o in outputs), extra), outputs


def part_throughput(runner, hf_model, pad_id: int, args) -> dict:
    prompts = make_prompts(args.num_requests, args.min_prompt_len, args.max_prompt_len,
                           runner.model_info.vocab_size, args.seed)
    num_prompt_tokens = sum(len(p) for p in prompts)
    print(f"\n[throughput] {len(prompts)} requests, prompts {args.min_prompt_len}-{args.max_prompt_len} tokens "
          f"({num_prompt_tokens} in all), {args.output_len} output tokens each, greedy, ignore_eos; "
          f"HF static batches of {args.hf_batch_size} | load average {load_avg()}", flush=True)
    runs: list[ThroughputRun] = []
    ours_tokens = hf_tokens = None
    for repeat in range(args.repeats):  # alternate the sides, so both see the same machine load
        run, ours_tokens = engine_throughput(runner, args, prompts, f"tput{repeat}")
        runs.append(run)
        print(f"  run {repeat} ours: {run.wall_s:7.1f} s {run.tokens_per_s:7.1f} tok/s {run.extra} "
              f"| load {load_avg()}", flush=True)
        if hf_model is not None:
            run, hf_tokens = hf_throughput(hf_model, args, prompts, pad_id)
            runs.append(run)
            print(f"  run {repeat} HF  : {run.wall_s:7.1f} s {run.tokens_per_s:7.1f} tok/s {run.extra} "
                  f"| load {load_avg()}", flush=True)
    best = {side: max((r for r in runs if r.side == side), key=lambda r: r.tokens_per_s)
            for side in {r.side for r in runs}}
    summary = {"num_prompt_tokens": num_prompt_tokens, "runs": [asdict(r) for r in runs],
               "best_tokens_per_s": {side: r.tokens_per_s for side, r in best.items()}}
    print(f"  best ours {best['ours'].tokens_per_s:.1f} tok/s", end="")
    if "hf" in best:
        ratio = best["ours"].tokens_per_s / best["hf"].tokens_per_s
        same = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
        summary.update(ratio=ratio, identical_sequences=same)
        print(f" | best HF {best['hf'].tokens_per_s:.1f} tok/s | ratio {ratio:.2f}x (target >= 3x) | "
              f"identical greedy sequences {same}/{len(prompts)}", end="")
    print(flush=True)
    return summary


# --- n=8 forking ----------------------------------------------------------------------------------
FORK_VARIANTS = (  # name, n=8 request?, prefix caching, first request alone until its first token
    ("n=8, one request", True, True, False),
    ("8 separate, prefix cache off", False, False, False),
    ("8 separate, prefix cache on, at once", False, True, False),
    ("8 separate, prefix cache on, staggered", False, True, True),
)


def fork_variant(runner, args, prompt: list[int], forked: bool, caching: bool, stagger: bool, tag: str) -> EngineRun:
    base = SamplingParams(max_tokens=args.fork_output_len, temperature=args.fork_temperature,
                          seed=args.seed, ignore_eos=True)
    if forked:
        prompts, params = [prompt], [dataclasses.replace(base, n=args.fork_n)]
    else:
        prompts, params = [prompt] * args.fork_n, [base.for_child(i) for i in range(args.fork_n)]
    engine = fresh_engine(runner, args, prefix_caching=caching)
    try:
        return asyncio.run(run_engine(engine, prompts, params, tag, stagger_first=stagger))
    finally:
        engine.close()


def part_fork(runner, args) -> dict:
    prompt = make_prompts(1, args.fork_prompt_len, args.fork_prompt_len, runner.model_info.vocab_size,
                          args.seed + 1)[0]
    print(f"\n[fork] one {len(prompt)}-token prompt, n={args.fork_n} vs {args.fork_n} separate requests, "
          f"{args.fork_output_len} tokens each, temperature {args.fork_temperature}, seed {args.seed}+i, "
          f"ignore_eos | load average {load_avg()}", flush=True)
    runs: dict[str, list[EngineRun]] = {name: [] for name, *_ in FORK_VARIANTS}
    for repeat in range(args.repeats):
        for name, forked, caching, stagger in FORK_VARIANTS:
            run = fork_variant(runner, args, prompt, forked, caching, stagger, f"fork{repeat}-{len(runs[name])}")
            runs[name].append(run)
            print(f"  run {repeat} {name:<40} {run.wall_s:6.2f} s, prompt tokens computed "
                  f"{run.num_prompt_tokens_computed:5d}, prefix hits {run.num_prefix_hit_tokens:5d}, "
                  f"output {run.num_output_tokens}", flush=True)
    forked_name = FORK_VARIANTS[0][0]
    best_forked = min(r.wall_s for r in runs[forked_name])
    header = (f"  {'variant':<40} | {'prompt computed':>15} | {'prefix hits':>11} | {'wall s (best)':>13} | "
              f"{'n=8 / this':>10} | same tokens as n=8")
    print(header + "\n  " + "-" * (len(header) - 2))
    summary = {}
    for name, variant_runs in runs.items():
        best = min(variant_runs, key=lambda r: r.wall_s)
        same = sum(a == b for a, b in zip(runs[forked_name][0].token_ids, variant_runs[0].token_ids))
        print(f"  {name:<40} | {best.num_prompt_tokens_computed:>15} | {best.num_prefix_hit_tokens:>11} | "
              f"{best.wall_s:>13.2f} | {best_forked / best.wall_s:>9.2f}x | {same}/{args.fork_n}")
        summary[name] = {"runs": [asdict(r) | {"token_ids": None} for r in variant_runs],
                         "ratio_forked_over_this": best_forked / best.wall_s, "same_tokens_as_forked": same}
    print("  target: n=8 computes the prompt once and takes <= 0.60x the wall time of "
          "'8 separate, prefix cache off'", flush=True)
    return summary


# --- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="local HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--parts", default="throughput,fork", help="comma-separated: throughput, fork")
    p.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    p.add_argument("--repeats", type=int, default=1, help="runs per side / variant; the best counts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=64)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--fork-n", type=int, default=8)
    p.add_argument("--fork-prompt-len", type=int, default=256)
    p.add_argument("--fork-output-len", type=int, default=64)
    p.add_argument("--fork-temperature", type=float, default=0.8)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the engine's token budget per step")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool blocks (default: every throughput request at its full length, plus 1)")
    p.add_argument("--result-json", default=None)
    return p.parse_args(argv)


def build_runner(args: argparse.Namespace):
    import torch

    from workers.loader import resolve_model_path
    from workers.model_runner import ModelRunner, RunnerConfig

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    max_len = max(args.max_prompt_len + args.output_len, args.fork_prompt_len + args.fork_output_len)
    blocks_per_seq = -(-max_len // args.block_size)
    num_blocks = args.num_blocks or max(args.num_requests, args.fork_n) * blocks_per_seq + 1
    runner = ModelRunner(RunnerConfig(model=str(model_dir), block_size=args.block_size, num_blocks=num_blocks,
                                      max_model_len=max_len + args.block_size, num_threads=args.threads))
    return model_dir, runner


def warm_up(runner, hf_model, pad_id: int, args) -> None:
    """First calls pay one-time costs (allocator, oneDNN primitives): keep them out of the timings."""
    prompts = make_prompts(4, 16, 48, runner.model_info.vocab_size, seed=99)
    warm_args = argparse.Namespace(**{**vars(args), "output_len": 4, "hf_batch_size": 4})
    engine_throughput(runner, warm_args, prompts, "warm")
    if hf_model is not None:
        hf_throughput(hf_model, warm_args, prompts, pad_id)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    model_dir, runner = build_runner(args)
    parts = args.parts.split(",")
    hf_model, pad_id = None, 0
    if "throughput" in parts and not args.skip_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    print(f"model {model_dir} | fp32 CPU | torch threads {torch.get_num_threads()} | "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} | {os.cpu_count()} CPUs | KV pool "
          f"{runner.model_info.num_blocks} blocks of {args.block_size} | budget {args.max_num_batched_tokens} "
          f"tokens/step | load average before {load_avg()}", flush=True)
    warm_up(runner, hf_model, pad_id, args)
    result = {"args": vars(args), "load_before": os.getloadavg()}
    if "throughput" in parts:
        result["throughput"] = part_throughput(runner, hf_model, pad_id, args)
    if "fork" in parts:
        result["fork"] = part_fork(runner, args)
    result["load_after"] = os.getloadavg()
    print(f"\nload average after {load_avg()}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
