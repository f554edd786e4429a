"""The simulation core: the real scheduler in virtual time, and the c16 closed loop replayed on it.

    .venv/bin/python -m bench.sim [--seeds 40] [--variant NAME:KEY=VALUE,...]
        [--cell c16|long-prompt|shared-prefix]

No model, no Ray, no wall clock: the real `Scheduler` (scheduler/scheduler.py) driven as the
engine drives it, an `InstantRunner` (scheduler/testing.py) for the tokens, and a step that lasts
`StepCost.of(step)` of virtual time. The shared pieces (StepCost, percentile, fast_block_hash)
also serve bench.bench_autoscale, whose workers are this core's scheduler under a router and an
autoscaling policy.

The CLI replays the c16 benchmark's closed loop. A served c16 run (bench.matrix: 16 clients, 64
requests of 256 prompt and 128 output tokens, ignore_eos) is one sample of how the waves of
requests line up, and whether they fall apart (docs/serving.md, "Keeping waves whole") depends
on how the arrivals happen to spread. One real run takes minutes; this replays the same loop in
virtual time, so scheduler rules can be compared over many arrival spreads in seconds:

- the real `Scheduler` with the deploy/serve.yaml settings, driven as the engine drives it
  with async scheduling: step N+1 is decided when step N starts;
- a worker whose step takes `base + per_decode * decoding rows + per_prompt * prompt tokens`
  (defaults fitted to the served bf16 worker on the Zen 4 VM: 27 ms for 16 decodes, 1.2 s
  for a 2048-token prefill step);
- clients that send their next request when the last token of the previous one lands; a
  request reaches the scheduler `latency` later, drawn per request (a floor plus an
  exponential tail). The first wave's latencies are drawn from a wider tail, as a cold
  connection pool and a busy ingress spread it in the real runs.

The long-prompt and shared-prefix cells replay bench.matrix's cells of those names (the
shared-prefix one with the client's warm-up of its first request). It prints, per variant, the
median and worst over the seeds of output tok/s, ITL p99, TTFT p99, the count of ITLs over
150 ms and the prompt tokens computed. Times are virtual: compare variants, not absolute
numbers with a served run.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
import statistics
from collections.abc import Sequence

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import InstantRunner

SHIPPED = SchedulerConfig(  # deploy/serve.yaml's scheduling settings
    max_num_batched_tokens=2048,
    max_num_seqs=64,
    num_blocks=4096,
    max_model_len=8192,
    long_prefill_token_threshold=512,
    long_prefill_tokens_while_decoding=128,
    async_scheduling=True,
    waiting_served_ratio=0.3,
    max_waiting_steps=20,
    hold_while_finishing_steps=4,
    min_shared_prefix_to_wait=256,
)


@dataclasses.dataclass(frozen=True)
class Workload:
    clients: int = 16
    requests: int = 64
    prompt_len: int = 256
    output_len: int = 128
    latency_floor_s: float = 0.005  # client -> scheduler, at least
    latency_mean_s: float = 0.015  # ...plus an exponential tail of this mean
    first_wave_mean_s: float = 0.3  # the first wave's tail (cold connections, busy ingress)
    long_prompt_len: int = 0  # >0: the long-prompt cell's long requests, at long_positions in the order sent
    long_positions: tuple[int, ...] = ()
    prefix_families: int = 0  # >0: request i's prompt is family i % F's system prompt, then prompt_len tokens
    prefix_len: int = 0  # tokens of each family's system prompt
    warm_first: bool = False  # the first request is computed once before the clock starts (the client's warm-up)

    @classmethod
    def long_prompt_cell(cls, **kw) -> Workload:
        """bench.matrix's long-prompt cell: 32 requests of 128 in / 128 out and 2 of 2048 in,
        sent 12th and 23rd (bench/datasets.py, long_prompt_requests), concurrency 16."""
        return cls(requests=34, prompt_len=128, long_prompt_len=2048, long_positions=(11, 22), **kw)

    @classmethod
    def shared_prefix_cell(cls, **kw) -> Workload:
        """bench.matrix's shared-prefix cell: 4 families of 1024-token system prompts, round-robin,
        32-token questions, 64 out, 32 requests at concurrency 8, the first one warmed up."""
        return cls(clients=8, requests=32, prompt_len=32, output_len=64, prefix_families=4, prefix_len=1024,
                   warm_first=True, **kw)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """A step's virtual duration: base + per_token * its tokens + per_seq * its rows, with prompt
    tokens priced apart at per_prompt_token when that is set (a decoding row is one token at
    per_token). The defaults: the served bf16 CPU worker of the c16 loop."""
    base_s: float = 0.006
    per_token_s: float = 0.0013
    per_prompt_token_s: float | None = 0.00058  # None: at per_token_s, like any token
    per_seq_s: float = 0.0

    def of(self, scheduler_output, prompt_rows: dict[str, bool] | None = None) -> float:
        """prompt_rows (request id -> still computing its prompt) is needed when prompt tokens are
        priced apart."""
        rows = scheduler_output.num_scheduled_tokens
        if self.per_prompt_token_s is None:
            cost = self.base_s + self.per_token_s * scheduler_output.total_num_scheduled_tokens
        else:
            decodes = sum(1 for rid in rows if not prompt_rows.get(rid))
            prompt_tokens = scheduler_output.total_num_scheduled_tokens - decodes
            cost = self.base_s + self.per_token_s * decodes + self.per_prompt_token_s * prompt_tokens
        return cost + self.per_seq_s * len(rows) if self.per_seq_s else cost


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The value at rank floor(q * n) of the sorted values (NaN for none)."""
    if not sorted_values:
        return math.nan
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def fast_block_hash(parent, token_ids):
    """A cheap HashFn for simulations: prompts are synthetic, collisions do not matter."""
    return hash((parent, tuple(token_ids)))


@dataclasses.dataclass
class RunResult:
    tokens_per_s: float
    itl_p99_ms: float
    ttft_p99_ms: float
    itls_over_150ms: int
    prompt_tokens: int  # prompt tokens the worker computed (prefix hits are not)
    timeline: list[str] = dataclasses.field(default_factory=list)  # per request: sent, first token, end, long gaps


def simulate(config: SchedulerConfig, workload: Workload, cost: StepCost, seed: int) -> RunResult:
    rng = random.Random(seed)
    scheduler = Scheduler(config)
    runner = InstantRunner()
    text_rng = random.Random(seed + 1_000_000)  # the shared-prefix cell's prompts, apart from rng's draws
    systems = [[text_rng.randrange(1, 49000) for _ in range(workload.prefix_len)]
               for _ in range(workload.prefix_families)]
    questions = [[text_rng.randrange(1, 49000) for _ in range(workload.prompt_len)]
                 for _ in range(workload.requests if systems else 0)]
    prompt_tokens = 0
    arrivals: list[tuple[float, int, EngineRequest]] = []  # (time at the scheduler, order, request)
    sent = 0
    sent_at: dict[str, float] = {}
    last_token_at: dict[str, float] = {}
    first_token_at: dict[str, float] = {}
    num_tokens: dict[str, int] = {}  # request -> tokens it has received
    prompt_left: dict[str, bool] = {}
    long_ids: set[str] = set()  # ITLs are the other requests' (the long-prompt cell reports its short streams')
    itls: list[float] = []
    long_gaps: dict[str, list[int]] = {}  # request -> output positions after a gap over 150 ms

    def send(now: float, mean: float) -> None:
        nonlocal sent
        if sent == workload.requests:
            return
        request_id = f"r{sent}"
        is_long = sent in workload.long_positions
        length = workload.long_prompt_len if is_long else workload.prompt_len
        if systems:
            prompt = systems[sent % len(systems)] + questions[sent]
        else:
            prompt = [rng.randrange(1, 49000) for _ in range(length)]  # no shared prefixes
        if is_long:
            long_ids.add(request_id)
        params = SamplingParams(max_tokens=workload.output_len, ignore_eos=True, temperature=0.0)
        latency = workload.latency_floor_s + rng.expovariate(1 / mean)
        heapq.heappush(arrivals, (now + latency, sent, EngineRequest(request_id, prompt, params, now + latency)))
        sent_at[request_id] = now
        sent += 1

    def admit_until(now: float) -> None:
        while arrivals and arrivals[0][0] <= now:
            _, _, request = heapq.heappop(arrivals)
            scheduler.add_request(request)
            prompt_left[request.request_id] = True

    def land(step, now: float) -> None:
        nonlocal prompt_tokens
        prompt_tokens += sum(n for rid, n in step.num_scheduled_tokens.items() if prompt_left.get(rid))
        for out in scheduler.update_from_output(step, runner.execute(step)):
            rid = out.request_id
            if not out.new_token_ids:
                continue
            prompt_left[rid] = False
            if rid in last_token_at:
                if rid not in long_ids:
                    itls.append(now - last_token_at[rid])
                if now - last_token_at[rid] > 0.150:
                    long_gaps.setdefault(rid, []).append(num_tokens[rid])
            else:
                first_token_at[rid] = now
            last_token_at[rid] = now
            num_tokens[rid] = num_tokens.get(rid, 0) + 1
            if out.finished:
                send(now, workload.latency_mean_s)

    if workload.warm_first:
        warm = EngineRequest("warm-up", systems[0] + questions[0], SamplingParams(max_tokens=1, temperature=0.0))
        scheduler.add_request(warm)
        while scheduler.has_unfinished_requests():
            step = scheduler.schedule()
            scheduler.update_from_output(step, runner.execute(step))
    for _ in range(workload.clients):
        send(0.0, workload.first_wave_mean_s)
    now = 0.0
    flight = None  # (scheduler output, end time)
    while flight is not None or arrivals or scheduler.has_unfinished_requests():
        if flight is None:
            admit_until(now)
            step = scheduler.schedule()
            if step.is_empty:
                now = max(now, arrivals[0][0]) if arrivals else now
                continue
            flight = (step, now + cost.of(step, prompt_left))
        step, end = flight
        admit_until(now)  # the step after is decided as this one starts
        ahead = scheduler.schedule_ahead()
        now = end
        land(step, now)
        flight = None if ahead.is_empty else (ahead, now + cost.of(ahead, prompt_left))
    duration = now
    itls.sort()
    ttfts = sorted(first_token_at[rid] - sent_at[rid] for rid in sent_at)
    return RunResult(
        tokens_per_s=workload.requests * workload.output_len / duration,
        itl_p99_ms=1000 * itls[int(0.99 * (len(itls) - 1))],
        ttft_p99_ms=1000 * ttfts[int(0.99 * (len(ttfts) - 1))],
        itls_over_150ms=sum(1 for x in itls if x > 0.150),
        prompt_tokens=prompt_tokens,
        timeline=[f"{rid:>4} sent {sent_at[rid]:6.2f} first token {first_token_at[rid]:6.2f}"
                  f" end {last_token_at[rid]:6.2f} long gaps at {long_gaps.get(rid, [])}" for rid in sent_at],
    )


def parse_variant(text: str) -> tuple[str, SchedulerConfig]:
    """NAME[:KEY=VALUE,...] over SHIPPED's fields ("null" for None)."""
    name, _, settings = text.partition(":")
    changes = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        current = getattr(SHIPPED, key)
        changes[key] = None if value == "null" else type(current if current is not None else 0)(value)
    return name, dataclasses.replace(SHIPPED, **changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--variant", action="append", default=[], help="NAME[:KEY=VALUE,...] of SchedulerConfig")
    parser.add_argument("--first-wave-mean", type=float, default=Workload.first_wave_mean_s)
    parser.add_argument("--trace", type=int, default=None, help="print this seed's timeline per request")
    parser.add_argument("--latency-mean", type=float, default=Workload.latency_mean_s)
    parser.add_argument("--cell", choices=["c16", "long-prompt", "shared-prefix"], default="c16")
    args = parser.parse_args()
    timing = {"first_wave_mean_s": args.first_wave_mean, "latency_mean_s": args.latency_mean}
    cells = {"c16": Workload, "long-prompt": Workload.long_prompt_cell, "shared-prefix": Workload.shared_prefix_cell}
    workload = cells[args.cell](**timing)
    variants = [parse_variant(v) for v in args.variant or ["shipped"]]
    print(f"{args.seeds} seeds | {workload}")
    print(f"{'variant':>16} | tok/s med (min) | ITL p99 ms med (max) | TTFT p99 ms med (max) | ITLs>150ms med (max)"
          " | prompt tokens computed med (max)")
    for name, config in variants:
        if args.trace is not None:
            print(f"{name}, seed {args.trace}:")
            print("\n".join(simulate(config, workload, StepCost(), args.trace).timeline))
        runs = [simulate(config, workload, StepCost(), seed) for seed in range(args.seeds)]
        tps = [r.tokens_per_s for r in runs]
        itl = [r.itl_p99_ms for r in runs]
        ttft = [r.ttft_p99_ms for r in runs]
        big = [r.itls_over_150ms for r in runs]
        computed = [r.prompt_tokens for r in runs]
        print(f"{name:>16} | {statistics.median(tps):6.1f} ({min(tps):6.1f})"
              f" | {statistics.median(itl):7.0f} ({max(itl):6.0f})"
              f" | {statistics.median(ttft):7.0f} ({max(ttft):6.0f}) | {statistics.median(big):5.0f} ({max(big):4d})"
              f" | {statistics.median(computed):6.0f} ({max(computed):6d})")


if __name__ == "__main__":
    main()
