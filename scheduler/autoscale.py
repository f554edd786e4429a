"""How many workers the scheduler actor wants, between min_workers and max_workers. Pure:
stdlib only, no Ray, no clock of its own (the caller passes `now`, in seconds).

The scheduler actor calls `AutoscalePolicy.decide(now, load)` every few seconds with one
`ClusterLoad` (a `WorkerLoad` per live worker, the parked requests and the recent queue-time
p90). The answer, a `ScaleDecision`, is absolute: `desired` workers (starting + serving;
draining ones do not count) and, when fewer are wanted, which worker to drain now. The caller
starts `desired - current` workers and reports them as "starting" in the next load, or drains
`retire` and reports it as "draining" until it is gone.

Signals, each against its target PER SERVING WORKER, with the number of serving workers that
would bring it under target if the load spread evenly over them:

    signal   value                                       over target when         workers needed
    queue    W = prompt tokens waiting, serving +        W > T_w * n              ceil(W / T_w)
             draining workers (queued + part-prefilled)
    kv       K = sum of serving workers' kv_use          K > T_kv * n             ceil(K / T_kv)
    latency  p90 of arrival -> first scheduling,         p90 > T_q and some       ceil(n * p90 / T_q)
             over the caller's last window               request waits now

    n = serving workers; T_w, T_kv, T_q = the config's targets. The latency model (queue time
    falls as 1 / workers) is crude; the max_workers clamp bounds it. The p90 lags (it covers
    the caller's window, which should be no longer than scale_up_delay_s), so it counts only
    while some request is waiting: a burst that has been served does not add a worker.

Algorithm, in order (the first rule that applies answers):

1. Bounds: current = starting + serving. Below min_workers: desired = min_workers ("min");
   above max_workers: desired = max_workers and retire one victim ("max"). No delay.
2. Wake: no worker at all and `parked > 0`: desired = 1 at once ("wake").
3. Only starting workers: nothing to measure yet ("steady").
4. Up: some signal is over target, continuously for scale_up_delay_s. Then desired =
   max(the most workers any over-target signal needs, n + 1), at most max_workers, the reason
   being that signal. Starting workers count as capacity already coming: while they cover what
   is needed nothing is added ("steady"), and more are added only once the need exceeds them
   for a whole scale_up_delay_s. Already at max_workers: "max". After an addition
   the timer starts again, so the next one needs the signal to hold another delay (the
   latency window still remembers requests that waited before the new workers came).
5. Down: every signal is under `scale_down_fraction` of its target (the hysteresis band),
   and so are the serving workers' running + waiting requests against their batches when
   `max_running_per_worker` is given; nothing is parked; and with one serving worker fewer
   nothing would be over target (nor over the batches),
   continuously for scale_down_delay_s. Then desired = current - 1 ("idle"), never below
   min_workers, retiring the victim. One worker at a time: not while another drains, and the
   next one after scale_down_step_s more of the same condition. The last worker (min_workers
   0) goes only when the cluster has been idle (nothing running, waiting or parked) for
   scale_down_delay_s.
6. Otherwise "steady". A timer resets whenever its condition breaks, so a burst shorter than
   scale_up_delay_s adds nothing and a lull shorter than scale_down_delay_s retires nothing.

Victim: a starting worker first (it holds no request and no cache yet: dropping it loses
nothing, and it never leaves the cluster with no serving worker while it loads), then among
serving workers the one with the fewest running + waiting requests, then the fewest
`unique_cached_blocks` (prefix blocks no other serving worker holds, lost with it), then the
highest worker_id.

Defaults (AutoscaleConfig), for a GPU deployment:
- scale_up_delay_s 30 s: long enough to ignore a burst that one batch absorbs, short next to
  a GPU worker's start-up (load weights, warm up, capture graphs: 30 s to minutes).
- scale_down_delay_s 600 s: a retired GPU worker costs a start-up to get back and its prefix
  cache is lost, so wait out short lulls (Ray Serve's downscale default).
- scale_down_step_s 60 s: after a retirement, the load that moved to the others shows in the
  signals within a few steps; a minute more is the margin before the next one.
- scale_down_fraction 0.5: scale down only when every signal is under half its target, so
  the count does not oscillate around one target.
- target_waiting_tokens_per_worker 8192: about half a second of prefill for an 8B-class model
  on one H100; more queued prompt work per worker shows up as TTFT.
- target_kv_use 0.9: above it the scheduler starts preempting (recomputing) sequences.
- target_queue_time_s 2.0: a TTFT budget of a couple of seconds for interactive use.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Set
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.request import Request
    from scheduler.scheduler import Scheduler

WORKER_STATES = ("starting", "serving", "draining")


@dataclass(frozen=True)
class AutoscaleConfig:
    min_workers: int  # workers kept at least (0: scale to zero when idle)
    max_workers: int  # workers at most (>= 1)
    scale_up_delay_s: float = 30.0  # a signal must hold this long before a worker is added
    scale_down_delay_s: float = 600.0  # ... and this long (idle / under target) before one is retired
    target_waiting_tokens_per_worker: int = 8192  # prompt tokens waiting (not yet computed) per serving worker
    target_kv_use: float = 0.9  # fraction of KV blocks in use
    target_queue_time_s: float = 2.0  # p90 time from arrival to first scheduling, over the last window
    scale_down_fraction: float = 0.5  # down only while every signal is under this share of its target
    scale_down_step_s: float = 60.0  # after a retirement, the condition must hold this long more for the next
    # The workers' max_num_seqs (None: not known). With it, a retirement also needs the running and
    # waiting requests under scale_down_fraction of every serving batch, and within the batches of
    # one worker fewer: a cluster whose batches are full holds no queue and may use little KV, but
    # retiring one of its workers would make requests wait.
    max_running_per_worker: int | None = None

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {self.max_workers}")
        if self.min_workers < 0:
            raise ValueError(f"min_workers must be at least 0, got {self.min_workers}")
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers ({self.min_workers}) must not exceed max_workers ({self.max_workers})")
        for name in ("scale_up_delay_s", "scale_down_delay_s", "scale_down_step_s"):
            value = getattr(self, name)
            if not value >= 0:  # also rejects NaN
                raise ValueError(f"{name} must be a non-negative number of seconds, got {value}")
        if self.target_waiting_tokens_per_worker < 1:
            raise ValueError(
                f"target_waiting_tokens_per_worker must be at least 1, got {self.target_waiting_tokens_per_worker}")
        if not 0 < self.target_kv_use <= 1:
            raise ValueError(f"target_kv_use must be in (0, 1], got {self.target_kv_use}")
        if not self.target_queue_time_s > 0:
            raise ValueError(f"target_queue_time_s must be positive, got {self.target_queue_time_s}")
        if not 0 <= self.scale_down_fraction < 1:
            raise ValueError(f"scale_down_fraction must be in [0, 1), got {self.scale_down_fraction}")
        if self.max_running_per_worker is not None and self.max_running_per_worker < 1:
            raise ValueError(f"max_running_per_worker must be at least 1 or None, got {self.max_running_per_worker}")


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: int
    state: str  # "starting" | "serving" | "draining"
    running: int  # requests in its batch
    waiting: int  # requests queued on it
    waiting_prompt_tokens: int  # prompt tokens not yet computed (queued + partially prefilled)
    kv_use: float  # 0..1
    unique_cached_blocks: int  # cached prefix blocks that no other serving worker also holds

    def __post_init__(self) -> None:
        if self.state not in WORKER_STATES:
            raise ValueError(f"worker {self.worker_id}: state must be one of {WORKER_STATES}, got {self.state!r}")


def prompt_tokens_left(request: Request) -> int:
    """Prompt (or recompute) tokens not yet computed; a decoding request has none."""
    left = request.num_tokens - request.num_computed_tokens
    return left if left > 1 or request.num_computed_tokens == 0 else 0


def worker_load(worker_id: int, state: str, scheduler: Scheduler, unique_cached_blocks: int) -> WorkerLoad:
    """One worker's WorkerLoad, read from its scheduler (the Ray shell and the benchmark both use it)."""
    pool = scheduler.kv.pool
    return WorkerLoad(
        worker_id=worker_id, state=state, running=scheduler.num_running_seqs, waiting=len(scheduler.waiting),
        waiting_prompt_tokens=(sum(map(prompt_tokens_left, scheduler.waiting))
                               + sum(map(prompt_tokens_left, scheduler.running))),
        kv_use=pool.num_used_blocks / pool.num_usable_blocks,
        unique_cached_blocks=unique_cached_blocks,
    )


def unique_cached_blocks(cached: Mapping[int, Set[object]], serving: Collection[int]) -> dict[int, int]:
    """Per worker of `cached` (worker id -> its cached block hashes): the blocks that no other
    serving worker holds, which retiring it would lose. `serving` is a subset of cached's keys."""
    holders = Counter(block for worker in serving for block in cached[worker])
    return {worker: sum(1 for block in blocks if holders[block] == (worker in serving))
            for worker, blocks in cached.items()}


@dataclass(frozen=True)
class ClusterLoad:
    workers: tuple[WorkerLoad, ...]
    parked: int  # requests waiting because no worker is serving (scale from zero)
    queue_time_p90_s: float | None  # over the last window; None when no request started in it


@dataclass(frozen=True)
class ScaleDecision:
    desired: int  # workers wanted (starting + serving; draining ones do not count)
    reason: str  # "steady", "queue", "kv", "latency", "wake", "idle", "min", "max"
    retire: int | None = None  # worker_id to drain now, when desired < current
    detail: str = ""  # what the signals read, for logs


@dataclass(frozen=True)
class _Need:
    """One over-target signal: the serving workers that would bring it under target."""

    reason: str  # "queue" | "kv" | "latency"
    workers: int  # serving workers needed
    detail: str  # its reading, for logs


class AutoscalePolicy:
    """Holds the timers between calls; `decide` is the whole interface."""

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._over_since: float | None = None  # since when some signal is over target
        self._under_since: float | None = None  # since when every signal is in the scale-down band
        self._idle_since: float | None = None  # since when nothing runs, waits or is parked
        self._last_retire: float | None = None  # when the last scale-down was decided

    def decide(self, now: float, load: ClusterLoad) -> ScaleDecision:
        cfg = self.config
        active = [w for w in load.workers if w.state != "draining"]
        serving = [w for w in active if w.state == "serving"]
        current = len(active)
        self._track_idle(now, load)
        if current < cfg.min_workers:
            self._reset()
            return ScaleDecision(cfg.min_workers, "min", detail=f"{current} workers < min_workers")
        if current > cfg.max_workers:
            self._reset()
            victim = _victim(active)
            return ScaleDecision(cfg.max_workers, "max", victim, f"{current} workers > max_workers")
        if current == 0:
            self._reset()
            if load.parked > 0:
                return ScaleDecision(1, "wake", detail=f"{load.parked} parked")
            return ScaleDecision(0, "steady")
        if not serving:
            self._reset()
            return ScaleDecision(current, "steady", detail=f"{current} starting")
        needs = self._needs(load, len(serving))
        if needs:
            return self._up(now, needs, current, len(serving))
        self._over_since = None
        return self._down(now, load, active, len(serving))

    # --- up ---------------------------------------------------------------------------------
    def _needs(self, load: ClusterLoad, num_serving: int) -> list[_Need]:
        cfg = self.config
        needs = []
        waiting = sum(w.waiting_prompt_tokens for w in load.workers if w.state != "starting")
        if waiting > cfg.target_waiting_tokens_per_worker * num_serving:
            needs.append(_Need("queue", math.ceil(waiting / cfg.target_waiting_tokens_per_worker),
                               f"{waiting} prompt tokens waiting over {num_serving} serving"))
        kv = sum(w.kv_use for w in load.workers if w.state == "serving")
        if kv > cfg.target_kv_use * num_serving:
            needs.append(_Need("kv", math.ceil(kv / cfg.target_kv_use),
                               f"KV use {kv / num_serving:.2f} on average over {num_serving} serving"))
        p90 = load.queue_time_p90_s
        queued = load.parked + sum(w.waiting for w in load.workers)
        if p90 is not None and p90 > cfg.target_queue_time_s and queued > 0:
            needs.append(_Need("latency", math.ceil(num_serving * p90 / cfg.target_queue_time_s),
                               f"queue time p90 {p90:.2f} s over {num_serving} serving"))
        return needs

    def _up(self, now: float, needs: list[_Need], current: int, num_serving: int) -> ScaleDecision:
        cfg = self.config
        self._under_since = None
        if self._over_since is None:
            self._over_since = now
        top = max(needs, key=lambda need: need.workers)  # the first of equals: queue, kv, latency
        detail = "; ".join(need.detail for need in needs)
        wanted = max(top.workers, num_serving + 1)
        if wanted <= current:  # the starting workers cover it: more must be needed for a whole delay
            self._over_since = now
            return ScaleDecision(current, "steady", detail=f"{current - num_serving} starting cover: {detail}")
        if now - self._over_since < cfg.scale_up_delay_s:
            return ScaleDecision(current, "steady", detail=f"over target for {now - self._over_since:.0f} s: {detail}")
        if current >= cfg.max_workers:
            return ScaleDecision(current, "max", detail=f"at max_workers: {detail}")
        self._over_since = now  # the next addition needs the signal to hold another delay
        return ScaleDecision(min(wanted, cfg.max_workers), top.reason, detail=detail)

    # --- down -------------------------------------------------------------------------------
    def _down(self, now: float, load: ClusterLoad, active: list[WorkerLoad], num_serving: int) -> ScaleDecision:
        cfg = self.config
        current = len(active)
        if not self._quiet(load, num_serving):
            self._under_since = None
            return ScaleDecision(current, "steady")
        if self._under_since is None:
            self._under_since = now
        last_one = current == 1
        since = self._idle_since if last_one else self._under_since
        held = since is not None and now - since >= cfg.scale_down_delay_s
        stepped = self._last_retire is None or now - self._last_retire >= cfg.scale_down_step_s
        draining = any(w.state == "draining" for w in load.workers)
        if current - 1 < cfg.min_workers or not held or not stepped or draining:
            return ScaleDecision(current, "steady")
        self._last_retire = now
        under_for = now - since
        return ScaleDecision(current - 1, "idle", _victim(active), f"under target for {under_for:.0f} s")

    def _quiet(self, load: ClusterLoad, num_serving: int) -> bool:
        """Every signal in the scale-down band, and none over target with one worker fewer."""
        cfg = self.config
        if load.parked > 0:
            return False
        fraction = cfg.scale_down_fraction
        waiting = sum(w.waiting_prompt_tokens for w in load.workers if w.state != "starting")
        kv = sum(w.kv_use for w in load.workers if w.state == "serving")
        p90 = load.queue_time_p90_s
        seats = cfg.max_running_per_worker
        requests = sum(w.running + w.waiting for w in load.workers if w.state == "serving")
        if (waiting > fraction * cfg.target_waiting_tokens_per_worker * num_serving
                or kv > fraction * cfg.target_kv_use * num_serving
                or (p90 is not None and p90 > fraction * cfg.target_queue_time_s)
                or (seats is not None and requests > fraction * seats * num_serving)):
            return False
        fewer = num_serving - 1
        if fewer == 0:
            return self._idle_since is not None  # the last serving worker: only an idle cluster
        return (waiting <= cfg.target_waiting_tokens_per_worker * fewer
                and kv <= cfg.target_kv_use * fewer
                and (p90 is None or p90 * num_serving / fewer <= cfg.target_queue_time_s)
                and (seats is None or requests <= seats * fewer))

    def _track_idle(self, now: float, load: ClusterLoad) -> None:
        idle = load.parked == 0 and all(w.running == 0 and w.waiting == 0 for w in load.workers)
        if not idle:
            self._idle_since = None
        elif self._idle_since is None:
            self._idle_since = now

    def _reset(self) -> None:
        self._over_since = None
        self._under_since = None


def _victim(candidates: list[WorkerLoad]) -> int:
    """The worker whose retirement costs least (see the module docstring)."""
    victim = min(candidates, key=lambda w: (w.state != "starting", w.running + w.waiting,
                                            w.unique_cached_blocks, -w.worker_id))
    return victim.worker_id
