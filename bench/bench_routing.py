"""Routing policies compared on a shared-prefix workload, same run, same workers.

    .venv/bin/python -m bench.bench_routing                           # SmolLM2, 2 workers
    .venv/bin/python -m bench.bench_routing --model tests-tiny-dir --families 8 --system-len 1024

Drives the pure EngineGroup (scheduler/engine_group.py) in-process, exactly as the
SchedulerActor does, over `--workers` real ModelRunners (each on its own thread with
`--threads` torch threads; no Ray, no HTTP, so the numbers are the routing's, not the
transport's). The runners (weights, KV pools) are built once and shared by every policy run;
each run gets fresh schedulers, so it starts with an empty prefix cache.

Workload: `--families` system prompts of `--system-len` random tokens, each followed by
`--questions` different questions of `--question-len` tokens; the requests of all families
are interleaved in a seeded random order (a strict 0,1,..,7 cycle would hand round robin a
perfect family-to-worker mapping whenever the family count is a multiple of the worker
count). A closed loop keeps `--concurrency` requests in flight; each generates
`--output-len` tokens (greedy, EOS ignored).

Per policy: prefix-cache hit tokens (each request's num_cached_tokens) against the ideal
(every request but the first of its family hits its whole system prompt, block-rounded),
TTFT p50/p99 (add_request to the first token), output throughput, and how requests split
over the workers. `--num-blocks` sizes each worker's KV pool: the default holds a bit more
than half the families' prefixes per worker, so routing decides whether the two pools act
as one big cache (families split across workers) or as two copies of a small one.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.engine import Engine  # noqa: E402
from scheduler.engine_group import EngineGroup, TimedRunner  # noqa: E402
from scheduler.outputs import EngineRequest  # noqa: E402
from scheduler.router import Router, RouterConfig  # noqa: E402
from scheduler.sampling_params import SamplingParams  # noqa: E402

POLICIES = ("prefix_aware", "round_robin", "least_loaded")


@dataclass(slots=True)
class Sample:
    family: int
    prompt_token_ids: list[int]


@dataclass(slots=True)
class RunResult:
    policy: str
    wall_s: float  # first request sent -> last request finished
    num_requests: int
    num_output_tokens: int
    hit_tokens: int  # sum of num_cached_tokens over requests
    ideal_hit_tokens: int
    ttft_s: list[float] = field(default_factory=list)  # per request
    routed_per_worker: list[int] = field(default_factory=list)
    busy_s_per_worker: list[float] = field(default_factory=list)  # seconds each worker spent in steps
    route_counts: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    prompt_tokens_computed: int = 0  # prefill work actually done (recompute included)

    @property
    def hit_fraction_of_ideal(self) -> float:
        return self.hit_tokens / max(1, self.ideal_hit_tokens)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    def ttft_percentile(self, q: float) -> float:
        ordered = sorted(self.ttft_s)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[Sample]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(3, vocab_size) for _ in range(args.system_len)] for _ in range(args.families)]
    remaining = {family: args.questions for family in range(args.families)}
    samples = []
    while remaining:
        family = rng.choice(sorted(remaining))
        remaining[family] -= 1
        if remaining[family] == 0:
            del remaining[family]
        question = [rng.randrange(3, vocab_size) for _ in range(args.question_len)]
        samples.append(Sample(family, systems[family] + question))
    return samples


def ideal_hit_tokens(samples: list[Sample], system_len: int, block_size: int) -> int:
    num_families = len({s.family for s in samples})
    return (len(samples) - num_families) * (system_len // block_size * block_size)


def make_group(runners: list, config: SchedulerConfig, eos: tuple[int, ...], policy: str) -> EngineGroup:
    timed = [TimedRunner(runner) for runner in runners]
    engines = [Engine(config, runner, eos) for runner in timed]
    return EngineGroup(engines, timed, router=Router(RouterConfig(policy=policy)))


async def run_policy(policy: str, run_id: str, runners: list, config: SchedulerConfig,
                     samples: list[Sample], args: argparse.Namespace) -> RunResult:
    group = make_group(runners, config, (), policy)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    queue = list(enumerate(samples))
    queue.reverse()
    ttfts: list[float] = []
    cached: list[int] = []
    num_output = 0

    async def client() -> None:
        nonlocal num_output
        while queue:
            index, sample = queue.pop()
            request_id = f"{run_id}-{index}"
            sent = time.perf_counter()
            stream = group.add_request(EngineRequest(request_id, sample.prompt_token_ids, params))
            first = None
            async for delta in stream:
                if delta.new_token_ids and first is None:
                    first = time.perf_counter()
                num_output += len(delta.new_token_ids)
                if delta.finished:
                    cached.append(delta.num_cached_tokens)
            group.forget(request_id)
            ttfts.append(first - sent)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    wall = time.perf_counter() - started
    stats = [engine.stats for engine in group.engines]
    routing = group.routing_stats()
    await asyncio.sleep(0)
    return RunResult(
        policy=policy, wall_s=wall, num_requests=len(samples), num_output_tokens=num_output,
        hit_tokens=sum(cached), ideal_hit_tokens=ideal_hit_tokens(samples, args.system_len, config.block_size),
        ttft_s=ttfts, routed_per_worker=routing["routed_per_worker"], route_counts=routing["route_counts"],
        busy_s_per_worker=[round(busy, 2) for busy in routing["busy_s_per_worker"]],
        num_preemptions=sum(s.num_preemptions for s in stats),
        prompt_tokens_computed=sum(s.num_prompt_tokens_computed for s in stats),
    )


def table(results: dict[str, RunResult]) -> str:
    base = results.get("round_robin")
    lines = [
        "| policy | hit tokens / ideal | TTFT p50 (s) | TTFT p99 (s) | p50 vs RR | output tok/s | tput vs RR "
        "| prefill tokens computed | requests per worker | preemptions |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for policy, r in results.items():
        p50 = r.ttft_percentile(0.5)
        vs_p50 = f"{p50 / base.ttft_percentile(0.5):.2f}x" if base else "-"
        vs_tput = f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x" if base else "-"
        lines.append(
            f"| {policy} | {r.hit_fraction_of_ideal:.1%} ({r.hit_tokens}/{r.ideal_hit_tokens}) | {p50:.2f} | "
            f"{r.ttft_percentile(0.99):.2f} | {vs_p50} | {r.output_tokens_per_s:.1f} | {vs_tput} | "
            f"{r.prompt_tokens_computed} | {'/'.join(map(str, r.routed_per_worker))} | {r.num_preemptions} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (process-wide; each runner has its own thread)")
    parser.add_argument("--families", type=int, default=8)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--questions", type=int, default=16, help="requests per family")
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV blocks per worker (null block included); default: 60%% of the families' prefixes + room")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--repeats", type=int, default=1, help="runs per policy, interleaved; the best throughput counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-json", default=None)
    return parser.parse_args()


def default_num_blocks(args: argparse.Namespace) -> int:
    blocks_per_prefix = -(-args.system_len // args.block_size)
    blocks_per_request = -(-(args.system_len + args.question_len + args.output_len) // args.block_size)
    cached = int(0.6 * args.families * blocks_per_prefix)  # a bit more than half the families
    return 1 + max(cached, blocks_per_request) + args.concurrency * 4


def main() -> None:
    args = parse_args()
    import torch

    from workers.loader import resolve_model_path
    from workers.model_runner import ModelRunner, RunnerConfig

    torch.set_num_threads(args.threads)
    model_dir = resolve_model_path(args.model)
    num_blocks = args.num_blocks or default_num_blocks(args)
    max_model_len = args.system_len + args.question_len + args.output_len + args.block_size
    runner_config = RunnerConfig(model=str(model_dir), block_size=args.block_size, num_blocks=num_blocks,
                                 max_model_len=max_model_len, num_threads=args.threads, seed=args.seed)
    runners = [ModelRunner(runner_config) for _ in range(args.workers)]
    info = runners[0].model_info
    config = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                             block_size=args.block_size, num_blocks=info.num_blocks, max_model_len=info.max_model_len)
    samples = make_workload(args, info.vocab_size)
    load_before = os.getloadavg()
    print(f"model {model_dir} | {args.workers} workers x {args.threads} torch threads | {num_blocks} KV blocks "
          f"of {args.block_size} per worker | {args.families} families x {args.questions} questions, system "
          f"{args.system_len} + question {args.question_len} tokens, output {args.output_len} | concurrency "
          f"{args.concurrency} | OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} | load average before "
          f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}", flush=True)
    warm = make_workload(argparse.Namespace(**{**vars(args), "families": 2, "questions": 2, "system_len": 64,
                                               "seed": args.seed + 1}), info.vocab_size)
    asyncio.run(run_policy("round_robin", "warmup", runners, config, warm, argparse.Namespace(**{
        **vars(args), "concurrency": 4, "system_len": 64})))
    policies = args.policies.split(",")
    best: dict[str, RunResult] = {}
    every: list[RunResult] = []
    for repeat in range(args.repeats):
        for policy in policies:
            result = asyncio.run(run_policy(policy, f"{policy}-{repeat}", runners, config, samples, args))
            every.append(result)
            print(f"  run {repeat} {policy:>13}: {result.wall_s:6.1f} s, hit {result.hit_fraction_of_ideal:.1%} of "
                  f"ideal, TTFT p50 {result.ttft_percentile(0.5):.2f} s p99 {result.ttft_percentile(0.99):.2f} s, "
                  f"{result.output_tokens_per_s:.1f} tok/s, per worker {result.routed_per_worker} requests "
                  f"{result.busy_s_per_worker} s busy, "
                  f"{result.route_counts}", flush=True)
            if policy not in best or result.output_tokens_per_s > best[policy].output_tokens_per_s:
                best[policy] = result
    load_after = os.getloadavg()
    print(table({policy: best[policy] for policy in policies}))
    print(f"load average after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "num_blocks": num_blocks, "load_before": load_before,
                       "load_after": load_after, "runs": [asdict(r) for r in every]}, f, indent=1)


if __name__ == "__main__":
    main()
