"""Worker autoscaling under a stepped load, simulated in virtual time with the real scheduler.

    .venv/bin/python -m bench.bench_autoscale [--phases 600:1,600:64,600:1] [--plot PATH]

A discrete-event simulation: no model, no Ray, no wall clock. Each worker is the real pure
`Scheduler` (scheduler/scheduler.py) stepped as the engine steps it (schedule ->
ModelRunnerOutput -> update_from_output, one step at a time) with an `InstantRunner` for the
tokens (the simulation core of bench/sim.py), and a step lasts a GPU-like `base + per_token * batched tokens + per_seq * sequences`
of virtual time (defaults 12 ms, 0.02 ms, 0.1 ms: a 2048-token prefill step takes about 53 ms,
a step of 16 decodes about 14 ms). A worker takes `--startup-s` (30 s: load weights, warm up)
from its start to serving, and counts as live (it holds a GPU) from its start until it is gone.

Load: closed-loop clients (streams); each sends a request when its previous one ends, with no
think time, of `--prompt-tokens` (2048) prompt and `--output-tokens` (128) output tokens on
average, each length drawn uniformly within +-`--length-spread` (50%) of its mean with a fixed
seed (equal lengths would march the streams in lockstep). Every prompt is distinct (no prefix
hits): a prompt-heavy load (retrieval, summaries), where the queue signal counts. The stream count follows `--phases`
(seconds:streams, ...). New and moved requests go to a serving worker by the production
`Router` (scheduler/router.py, default prefix-aware policy: with no shared prefixes, the
worker with the most KV room after its queued work); with none serving they are parked.

Workers: `--max-num-seqs` (16) sequences each and a KV pool of `--num-blocks` (3600 blocks of
16 tokens, room for 16 of the longest requests), so a worker serves 16 streams without
queueing and the default peak of 64 streams needs exactly 4. At 3 workers 16 requests wait,
about 32k prompt tokens over 3 workers, over the policy's default queue target (8192 per
worker): the policy has a signal that says the maximum is needed, which is what makes the
comparison below fair. With P=512 those 16 requests would read 8k tokens, under target, and
queue about a second, under the 2 s latency target: a cluster grown to 3 workers gradually
would see no reason for the fourth (from 1 worker the policy still jumps to 4, on latency).
The policy is told the batch size (max_running_per_worker = max_num_seqs), so full batches
are not mistaken for a quiet cluster.

Runs, on the same load: fixed `--min-workers` (1), fixed `--max-workers` (4), and autoscaling
between them with `AutoscalePolicy` (scheduler/autoscale.py), decided every
`--decide-every-s`, the queue-time p90 over the last `--queue-window-s`. Scale-down drains: the
retired worker takes no new requests and finishes what it holds up to `--drain-timeout-s`;
what is left then is moved (recomputed from prompt + tokens so far) to a serving worker.

The default load: 1 stream for 10 minutes, 64 for 10 (the peak, a third of the time), 1 for
10. The peak is 10 minutes so that the minute the autoscaler needs to see it (30 s delay)
and bring workers up (30 s start-up) shows in the peak's TTFT tail but not in its p90: the
requests sent in that minute are 3% of the peak's. Shorter peaks fail the TTFT goal
(a 150 s peak: p90 26x the fixed maximum's), as any reactive policy must.
Delays: the policy's scale-up delay (30 s) and a scale-down delay of 120 s (the policy's
600 s default is for production, where a lull is worth riding out; over a 10-minute phase
it would hold all four workers for the whole last phase). Both are printed.

Per run: TTFT p50/p90 over the requests sent in the peak phase and over all, output tok/s,
worker-seconds (the integral of live workers: starting, serving and draining), scale events.
The goal: autoscaling keeps the peak's TTFT p90 within 1.2x of the fixed maximum's, with at
most 0.6x of its worker-seconds. `--plot` writes streams, live workers by state and desired
workers over time for the autoscaling run, and TTFT over time for all three.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from bench.sim import StepCost, fast_block_hash, percentile
from scheduler.autoscale import (
    AutoscaleConfig,
    AutoscalePolicy,
    ClusterLoad,
    ScaleDecision,
    unique_cached_blocks,
    worker_load,
)
from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest, SchedulerOutput
from scheduler.request import Request
from scheduler.router import Router, route_request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import InstantRunner

DEFAULT_PLOT = "/tmp/bench_autoscale.png"


# a GPU-like worker: per step, per batched token (prompt or decode alike), per sequence in the step
GPU_STEP = StepCost(base_s=0.012, per_token_s=0.00002, per_prompt_token_s=None, per_seq_s=0.0001)


@dataclass(frozen=True)
class Phase:
    duration_s: float  # virtual seconds
    streams: int  # closed-loop clients active in it


@dataclass(frozen=True)
class Setup:
    phases: tuple[Phase, ...] = (Phase(600.0, 1), Phase(600.0, 64), Phase(600.0, 1))
    prompt_tokens: int = 2048  # per request on average, all distinct
    output_tokens: int = 128  # per request on average (EOS ignored)
    length_spread: float = 0.5  # each request's lengths are drawn uniformly within +-this share of the mean
    seed: int = 0  # for the lengths
    worker: SchedulerConfig = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, block_size=16,
                                              num_blocks=3600, max_model_len=4096)
    step_time: StepCost = GPU_STEP
    startup_s: float = 30.0  # a worker's start to serving
    drain_timeout_s: float = 30.0  # a retired worker finishes what it holds up to this, then moves the rest
    decide_every_s: float = 1.0  # policy cadence
    queue_window_s: float = 30.0  # the queue-time p90's window

    @property
    def peak_phase(self) -> int:
        return max(range(len(self.phases)), key=lambda i: self.phases[i].streams)


@dataclass(slots=True)
class SimWorker:
    worker_id: int
    scheduler: Scheduler
    runner: InstantRunner
    state: str  # "starting" | "serving" | "draining"
    started_at: float  # virtual seconds: it holds a GPU from here
    gone_at: float | None = None  # ...to here
    step: SchedulerOutput | None = None  # in flight
    drain_expired: bool = False  # the drain timeout passed: move what is left once the step lands


@dataclass(slots=True)
class RequestRecord:
    client: int
    sent_at: float
    scheduled_at: float | None = None  # first scheduled for compute
    first_token_at: float | None = None
    finished_at: float | None = None
    num_tokens: int = 0  # output tokens received
    max_tokens: int = 0  # output tokens asked for
    num_moves: int = 0  # times moved off a draining worker


@dataclass(slots=True)
class TimelinePoint:
    t: float
    streams: int
    starting: int
    serving: int
    draining: int
    desired: int


@dataclass
class RunResult:
    name: str
    records: dict[str, RequestRecord]
    end_s: float  # the last request finished (>= the load's end)
    worker_seconds: float
    events: list[tuple[float, str, int, str]]  # (time, "start" | "retire" | "gone", worker id, reason)
    decisions: list[tuple[float, ScaleDecision]]  # every decision that asked for a change
    timeline: list[TimelinePoint] = field(default_factory=list)
    peak_window: tuple[float, float] = (0.0, 0.0)  # the peak phase's [start, end)

    def ttfts(self, window: tuple[float, float] | None = None) -> list[float]:
        lo, hi = window or (-math.inf, math.inf)
        return sorted(r.first_token_at - r.sent_at for r in self.records.values()
                      if r.first_token_at is not None and lo <= r.sent_at < hi)

    @property
    def output_tokens(self) -> int:
        return sum(r.num_tokens for r in self.records.values())


class Simulation:
    """One run: a policy over simulated workers under the setup's load."""

    def __init__(self, name: str, setup: Setup, config: AutoscaleConfig) -> None:
        self.name = name
        self.setup = setup
        self.policy = AutoscalePolicy(config)
        self.router = Router()
        self.workers: dict[int, SimWorker] = {}  # every worker ever, by id
        self.records: dict[str, RequestRecord] = {}
        self.parked: deque[EngineRequest | Request] = deque()
        self.queue_times: deque[tuple[float, float]] = deque()  # (first scheduled at, queue time)
        self.events: list[tuple[float, str, int, str]] = []
        self.decisions: list[tuple[float, ScaleDecision]] = []
        self.timeline: list[TimelinePoint] = []
        self.heap: list[tuple[float, int, str, int]] = []  # (time, order, kind, arg)
        self.order = 0
        self.streams = 0
        self.client_busy: set[int] = set()
        self.load_end = sum(p.duration_s for p in setup.phases)
        self.num_unfinished = 0
        self.rng = random.Random(setup.seed)
        self.body = [7 + (i % 4000) for i in range(self.longest(setup.prompt_tokens))]

    # --- the event loop --------------------------------------------------------------------
    def push(self, t: float, kind: str, arg: int = 0) -> None:
        self.order += 1
        heapq.heappush(self.heap, (t, self.order, kind, arg))

    def run(self) -> RunResult:
        for _ in range(self.policy.config.min_workers):
            self.new_worker(0.0, "serving", "initial")
        t = 0.0
        for i, phase in enumerate(self.setup.phases):
            self.push(t, "phase", i)
            t += phase.duration_s
        self.push(0.0, "decide")
        now = 0.0
        while self.heap:
            now, _, kind, arg = heapq.heappop(self.heap)
            if kind == "decide" and now >= self.load_end and self.num_unfinished == 0:
                break
            getattr(self, "on_" + kind)(now, arg)
        for w in self.workers.values():
            if w.gone_at is None:
                w.gone_at = now
        worker_seconds = sum(w.gone_at - w.started_at for w in self.workers.values())
        peak = self.setup.peak_phase
        start = sum(p.duration_s for p in self.setup.phases[:peak])
        return RunResult(self.name, self.records, now, worker_seconds, self.events, self.decisions, self.timeline,
                         (start, start + self.setup.phases[peak].duration_s))

    def on_phase(self, now: float, index: int) -> None:
        self.streams = self.setup.phases[index].streams
        for client in range(self.streams):
            if client not in self.client_busy:
                self.send(now, client)

    def on_step_end(self, now: float, worker_id: int) -> None:
        self.land(now, self.workers[worker_id])

    def on_ready(self, now: float, worker_id: int) -> None:
        w = self.workers[worker_id]
        if w.state != "starting":
            return  # retired while starting
        w.state = "serving"
        self.events.append((now, "serving", worker_id, ""))
        while self.parked:
            self.route(now, self.parked.popleft())

    def on_drain_deadline(self, now: float, worker_id: int) -> None:
        w = self.workers[worker_id]
        if w.gone_at is not None:
            return
        w.drain_expired = True
        if w.step is None:
            self.move_rest(now, w)

    def on_decide(self, now: float, _: int) -> None:
        decision = self.policy.decide(now, self.cluster_load(now))
        live = [w for w in self.workers.values() if w.gone_at is None]
        current = sum(1 for w in live if w.state != "draining")
        if decision.desired > current:
            self.decisions.append((now, decision))
            for _ in range(decision.desired - current):
                self.new_worker(now, "starting", decision.reason)
        elif decision.retire is not None:
            self.decisions.append((now, decision))
            self.retire(now, self.workers[decision.retire], decision.reason)
        counts = {state: sum(1 for w in self.workers.values() if w.gone_at is None and w.state == state)
                  for state in ("starting", "serving", "draining")}
        self.timeline.append(TimelinePoint(now, self.streams, counts["starting"], counts["serving"],
                                           counts["draining"], decision.desired))
        self.push(now + self.setup.decide_every_s, "decide")

    # --- workers ---------------------------------------------------------------------------
    def new_worker(self, now: float, state: str, reason: str) -> None:
        worker_id = len(self.workers)
        scheduler = Scheduler(self.setup.worker, hash_fn=fast_block_hash)
        self.workers[worker_id] = SimWorker(worker_id, scheduler, InstantRunner(), state, now)
        self.events.append((now, "start", worker_id, reason))
        if state == "starting":
            self.push(now + self.setup.startup_s, "ready", worker_id)

    def retire(self, now: float, w: SimWorker, reason: str) -> None:
        self.events.append((now, "retire", w.worker_id, reason))
        w.state = "draining"
        self.push(now + self.setup.drain_timeout_s, "drain_deadline", w.worker_id)
        self.maybe_gone(now, w)

    def maybe_gone(self, now: float, w: SimWorker) -> None:
        if (w.state == "draining" and w.gone_at is None and w.step is None
                and not w.scheduler.has_unfinished_requests()):
            w.gone_at = now
            self.events.append((now, "gone", w.worker_id, ""))

    def move_rest(self, now: float, w: SimWorker) -> None:
        """The drain timed out: what the worker still holds is recomputed elsewhere."""
        for request in w.scheduler.take_requests_for_migration():
            self.records[request.client_request_id].num_moves += 1
            self.route(now, request)
        self.maybe_gone(now, w)

    def kick(self, now: float, w: SimWorker) -> None:
        """Starts the worker's next step if it is idle and has work."""
        if w.step is not None or w.state == "starting" or not w.scheduler.has_unfinished_requests():
            return
        step = w.scheduler.schedule()
        assert not step.is_empty, "no progress while requests are unfinished"
        for rid in step.num_scheduled_tokens:
            record = self.records[rid]
            if record.scheduled_at is None:
                record.scheduled_at = now
                self.queue_times.append((now, now - record.sent_at))
        w.step = step
        self.push(now + self.setup.step_time.of(step), "step_end", w.worker_id)

    def land(self, now: float, w: SimWorker) -> None:
        step, w.step = w.step, None
        for out in w.scheduler.update_from_output(step, w.runner.execute(step)):
            record = self.records[out.request_id]
            if out.new_token_ids and record.first_token_at is None:
                record.first_token_at = now
            record.num_tokens += len(out.new_token_ids)
            if out.finished:
                record.finished_at = now
                self.num_unfinished -= 1
                self.client_busy.discard(record.client)
                if record.client < self.streams and now < self.load_end:
                    self.send(now, record.client)
        if w.drain_expired:
            self.move_rest(now, w)
        self.kick(now, w)
        self.maybe_gone(now, w)

    # --- requests --------------------------------------------------------------------------
    def longest(self, mean: int) -> int:
        return math.floor(mean * (1 + self.setup.length_spread))

    def draw(self, mean: int) -> int:
        spread = self.setup.length_spread
        return max(1, round(mean * self.rng.uniform(1 - spread, 1 + spread)))

    def send(self, now: float, client: int) -> None:
        n = len(self.records)
        request_id = f"r{n}"
        prompt = [1 + n // 30000, 1 + n % 30000] + self.body[:max(0, self.draw(self.setup.prompt_tokens) - 2)]
        params = SamplingParams(max_tokens=self.draw(self.setup.output_tokens), ignore_eos=True, temperature=0.0)
        self.records[request_id] = RequestRecord(client, now, max_tokens=params.max_tokens)
        self.client_busy.add(client)
        self.num_unfinished += 1
        self.route(now, EngineRequest(request_id, prompt, params, arrival_time=now))

    def route(self, now: float, item: EngineRequest | Request) -> None:
        serving = {w.worker_id: w.scheduler for w in self.workers.values()
                   if w.state == "serving" and w.gone_at is None}
        if not serving:
            self.parked.append(item)
            return
        tokens = item.prompt_token_ids if isinstance(item, EngineRequest) else list(item.all_token_ids)
        chosen = self.workers[route_request(self.router, serving, tokens).worker_id]
        if isinstance(item, EngineRequest):
            chosen.scheduler.add_request(item)
        else:
            chosen.scheduler.add_migrated_request(item)
        self.kick(now, chosen)

    # --- what the policy sees --------------------------------------------------------------
    def cluster_load(self, now: float) -> ClusterLoad:
        live = [w for w in self.workers.values() if w.gone_at is None]
        unique = unique_cached_blocks({w.worker_id: w.scheduler.kv.pool.cached.keys() for w in live},
                                      [w.worker_id for w in live if w.state == "serving"])
        loads = [worker_load(w.worker_id, w.state, w.scheduler, unique[w.worker_id]) for w in live]
        while self.queue_times and self.queue_times[0][0] < now - self.setup.queue_window_s:
            self.queue_times.popleft()
        recent = sorted(q for _, q in self.queue_times)
        return ClusterLoad(tuple(loads), len(self.parked), percentile(recent, 0.9) if recent else None)


# --- running and reporting -----------------------------------------------------------------
def simulate(setup: Setup, name: str, config: AutoscaleConfig) -> RunResult:
    return Simulation(name, setup, config).run()


def compare(setup: Setup, autoscale: AutoscaleConfig, jobs: int = 1) -> list[RunResult]:
    """Fixed min, fixed max and autoscaling on the same load (`jobs` processes at a time)."""
    low, high = autoscale.min_workers, autoscale.max_workers
    runs = [
        (setup, f"fixed {low}", dataclasses.replace(autoscale, min_workers=low, max_workers=low)),
        (setup, f"fixed {high}", dataclasses.replace(autoscale, min_workers=high, max_workers=high)),
        (setup, f"autoscale {low}-{high}", autoscale),
    ]
    if jobs <= 1:
        return [simulate(*run) for run in runs]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(simulate, *zip(*runs)))


def table(runs: list[RunResult]) -> str:
    lines = ["| run | TTFT p50 peak (ms) | TTFT p90 peak (ms) | TTFT p50 all (ms) | TTFT p90 all (ms) "
             "| output tok/s | worker-seconds | scale events |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for run in runs:
        peak, every = run.ttfts(run.peak_window), run.ttfts()
        events = [f"{e[1]} w{e[2]} @{e[0]:.0f}s ({e[3]})" for e in run.events
                  if e[1] in ("start", "retire") and e[0] > 0]
        lines.append(
            f"| {run.name} | {1000 * percentile(peak, 0.5):.0f} | {1000 * percentile(peak, 0.9):.0f} "
            f"| {1000 * percentile(every, 0.5):.0f} | {1000 * percentile(every, 0.9):.0f} "
            f"| {run.output_tokens / run.end_s:.0f} | {run.worker_seconds:.0f} | {'; '.join(events) or '-'} |")
    return "\n".join(lines)


def verdict(fixed_max: RunResult, auto: RunResult) -> str:
    ratio_ttft = percentile(auto.ttfts(auto.peak_window), 0.9) / percentile(fixed_max.ttfts(fixed_max.peak_window), 0.9)
    ratio_ws = auto.worker_seconds / fixed_max.worker_seconds
    ok = ratio_ttft <= 1.2 and ratio_ws <= 0.6
    return (f"autoscale / {fixed_max.name}: TTFT p90 at the peak {ratio_ttft:.2f}x (goal <= 1.2x), "
            f"worker-seconds {ratio_ws:.2f}x (goal <= 0.6x): {'met' if ok else 'NOT met'}")


def plot(runs: list[RunResult], auto: RunResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    t = [p.t for p in auto.timeline]
    top.stackplot(t, [p.serving for p in auto.timeline], [p.starting for p in auto.timeline],
                  [p.draining for p in auto.timeline], labels=["serving", "starting", "draining"],
                  colors=["tab:green", "tab:orange", "tab:gray"], alpha=0.6, step="post")
    top.step(t, [p.desired for p in auto.timeline], where="post", color="black", label="desired")
    top.set_ylabel(f"workers ({auto.name})")
    streams = top.twinx()
    streams.step(t, [p.streams for p in auto.timeline], where="post", color="tab:blue", linestyle="--")
    streams.set_ylabel("streams (dashed)", color="tab:blue")
    top.legend(loc="upper left")
    for run, color in zip(runs, ("tab:red", "tab:purple", "tab:green")):
        done = sorted((r.sent_at, r.first_token_at - r.sent_at) for r in run.records.values() if r.first_token_at)
        bottom.scatter([x for x, _ in done], [y for _, y in done], s=2, color=color, label=run.name, alpha=0.5)
    bottom.set_yscale("log")
    bottom.set_ylabel("TTFT (s), by send time")
    bottom.set_xlabel("virtual time (s)")
    bottom.legend(loc="upper left", markerscale=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_phases(text: str) -> tuple[Phase, ...]:
    phases = []
    for item in text.split(","):
        seconds, _, streams = item.partition(":")
        phases.append(Phase(float(seconds), int(streams)))
    return tuple(phases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d, w, st = Setup(), Setup().worker, GPU_STEP
    parser.add_argument("--phases", default="600:1,600:64,600:1", help="seconds:streams,...")
    parser.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    parser.add_argument("--output-tokens", type=int, default=d.output_tokens)
    parser.add_argument("--length-spread", type=float, default=d.length_spread)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--max-num-seqs", type=int, default=w.max_num_seqs)
    parser.add_argument("--num-blocks", type=int, default=w.num_blocks)
    parser.add_argument("--step-base-ms", type=float, default=1000 * st.base_s)
    parser.add_argument("--step-per-token-ms", type=float, default=1000 * st.per_token_s)
    parser.add_argument("--step-per-seq-ms", type=float, default=1000 * st.per_seq_s)
    parser.add_argument("--startup-s", type=float, default=d.startup_s)
    parser.add_argument("--drain-timeout-s", type=float, default=d.drain_timeout_s)
    parser.add_argument("--decide-every-s", type=float, default=d.decide_every_s)
    parser.add_argument("--queue-window-s", type=float, default=d.queue_window_s)
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=4)
    parser.add_argument("--scale-up-delay-s", type=float, default=AutoscaleConfig(1, 1).scale_up_delay_s)
    parser.add_argument("--scale-down-delay-s", type=float, default=120.0)
    parser.add_argument("--scale-down-step-s", type=float, default=AutoscaleConfig(1, 1).scale_down_step_s)
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="PNG path; empty: no plot")
    parser.add_argument("--jobs", type=int, default=1, help="runs simulated at once, one process each")
    args = parser.parse_args()
    setup = Setup(
        phases=parse_phases(args.phases), prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
        length_spread=args.length_spread, seed=args.seed,
        worker=dataclasses.replace(w, max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks, max_model_len=max(
            w.max_model_len, math.ceil((args.prompt_tokens + args.output_tokens) * (1 + args.length_spread)) + 1)),
        step_time=StepCost(base_s=args.step_base_ms / 1000, per_token_s=args.step_per_token_ms / 1000,
                           per_prompt_token_s=None, per_seq_s=args.step_per_seq_ms / 1000),
        startup_s=args.startup_s, drain_timeout_s=args.drain_timeout_s, decide_every_s=args.decide_every_s,
        queue_window_s=args.queue_window_s,
    )
    autoscale = AutoscaleConfig(args.min_workers, args.max_workers, scale_up_delay_s=args.scale_up_delay_s,
                                scale_down_delay_s=args.scale_down_delay_s, scale_down_step_s=args.scale_down_step_s,
                                max_running_per_worker=setup.worker.max_num_seqs)
    print(f"load: {', '.join(f'{p.streams} streams for {p.duration_s:.0f} s' for p in setup.phases)}; "
          f"{setup.prompt_tokens} prompt + {setup.output_tokens} output tokens per request on average "
          f"(+-{100 * setup.length_spread:.0f}%, seed {setup.seed})")
    print(f"worker: max_num_seqs {setup.worker.max_num_seqs}, {setup.worker.num_blocks} blocks of "
          f"{setup.worker.block_size}, budget {setup.worker.max_num_batched_tokens}; step {setup.step_time}; "
          f"start-up {setup.startup_s:.0f} s, drain timeout {setup.drain_timeout_s:.0f} s")
    print(f"policy: {autoscale}; decided every {setup.decide_every_s} s, queue-time window {setup.queue_window_s} s")
    runs = compare(setup, autoscale, args.jobs)
    print()
    print(table(runs))
    print()
    print(verdict(runs[1], runs[2]))
    if args.plot:
        plot(runs, runs[2], args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
