"""The metric catalog, a pure in-memory store, and EngineMetrics (core stats -> metrics).

One catalog names every metric once: name (prefix `rayllm_`), kind, help text, label names,
histogram buckets. Two kinds of backend take the same calls, `inc`, `set`, `observe`:

    MetricStore  (here, pure)          -> snapshot() -> plain data the ingress renders on /metrics
    RayMetrics   (scheduler/actor.py)  -> ray.util.metrics -> Ray's Prometheus export

so the ingress's /metrics and Ray's export carry the same names by construction (Ray's
export prefixes `ray_`, and both add `_total` to counters; see prometheus_name()).

EngineMetrics is the StatsSink the scheduler actor gives its engines: it turns each
StepStats and RequestStats into backend calls, and `refresh_gauges` sets the per-worker
gauges from the schedulers' live state (so they return to 0 after an abort, with no step).
Step counters are incremented per step; the router's cumulative route_counts are sent as
increments since the last publication. A backend that raises is logged once and skipped:
metrics never break the engine.
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from scheduler.outputs import FinishReason
from scheduler.router import RouteOutcome
from scheduler.stats import RequestStats, StepStats

logger = logging.getLogger(__name__)

PREFIX = "rayllm_"
Kind = Literal["counter", "gauge", "histogram"]
# RequestStats.finish_reason values: a sequence's own reasons, plus "error" (the engine failed
# it, RequestStream.fail) and "mixed" (n>1 choices that finished differently)
FINISH_REASONS = (*(reason.value for reason in FinishReason), "error", "mixed")

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                           1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
REQUEST_BUCKETS_S = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                     120.0, 240.0, 480.0, 960.0, 1920.0)
STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BATCH_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class MetricDef:
    name: str  # full name, PREFIX included, without the counter's `_total`
    kind: Kind
    help: str  # one sentence, with the unit
    labels: tuple[str, ...] = ()  # label names, in the order label values are passed
    buckets: tuple[float, ...] = ()  # histogram upper bounds, increasing (+Inf is implied)

    def __post_init__(self) -> None:
        assert self.name.startswith(PREFIX) and not self.name.endswith("_total"), self.name
        assert (self.kind == "histogram") == bool(self.buckets), self.name
        assert list(self.buckets) == sorted(set(self.buckets)), self.name


def _c(name: str, help: str, *labels: str) -> MetricDef:
    return MetricDef(PREFIX + name, "counter", help, labels)


def _g(name: str, help: str, *labels: str) -> MetricDef:
    return MetricDef(PREFIX + name, "gauge", help, labels)


def _h(name: str, help: str, buckets: Sequence[float], *labels: str) -> MetricDef:
    return MetricDef(PREFIX + name, "histogram", help, labels, tuple(buckets))


WORKER_STATES = ("starting", "serving", "draining")  # a live worker's states (scheduler/engine_group.py)
SCALE_EVENTS = (("up", "queue"), ("up", "kv"), ("up", "latency"), ("up", "wake"), ("up", "min"),
                ("down", "idle"), ("down", "max"))  # (direction, reason) of scheduler/autoscale.py's decisions

# Recorded by the scheduler actor (one per model or shard). `worker` is the worker's label.
ENGINE_METRICS: tuple[MetricDef, ...] = (
    _c("requests_finished", "Client requests the engine finished, by finish reason (stop|length|abort|"
       "error; mixed: n>1 choices that differ; abort includes clients that left and stop strings, "
       "which the ingress ends).", "finish_reason"),
    _c("prompt_tokens", "Prompt tokens of the requests the engine finished."),
    _c("generation_tokens", "Tokens sampled (generated), every sequence.", "worker"),
    _c("prompt_tokens_computed", "Prompt tokens computed by the model (prefix-cache hits excluded, "
       "recomputation after preemption included).", "worker"),
    _c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache on admission.", "worker"),
    _c("prefix_cache_hits", "Prompt tokens found in the prefix cache on admission (whole blocks).", "worker"),
    _c("preemptions", "Sequences preempted (KV blocks freed, recomputed later).", "worker"),
    _c("routing_decisions", "New requests routed to a worker, by the router's outcome.", "outcome"),
    _c("lora_routing_decisions", "Requests of a LoRA adapter routed to a worker that holds it (hit) or will "
       "load it (load).", "result"),
    _c("lora_requests", "Client requests of each LoRA adapter.", "lora_name"),
    _c("lora_generation_tokens", "Tokens sampled for requests of each LoRA adapter.", "lora_name"),
    _c("lora_loads", "LoRA adapters loaded by the worker (misses of its adapter LRU).", "worker"),
    _c("lora_evictions", "LoRA adapters unloaded by the worker (the least recently used, or removed).", "worker"),
    _g("lora_adapters_loaded", "LoRA adapters the worker holds now.", "worker"),
    _g("num_requests_running", "Sequences in the running batch.", "worker"),
    _g("num_requests_waiting", "Requests queued for admission (preempted ones included).", "worker"),
    _g("kv_cache_blocks_used", "KV cache blocks referenced by requests.", "worker"),
    _g("kv_cache_blocks_capacity", "Usable KV cache blocks, used or not (the pool without its null block).", "worker"),
    _g("worker_alive", "1 when the worker answers (or steps), 0 when it is known dead.", "worker"),
    _g("workers", "Workers by state: starting (loading, takes no requests), serving, draining (finishing "
       "its requests before it goes).", "state"),
    _g("workers_desired", "Workers the autoscaling policy wants, starting and serving (without autoscaling: "
       "the fixed count)."),
    _c("scale_events", "Workers added (direction up) or retired (down) by the autoscaling policy, by the "
       "policy's reason.", "direction", "reason"),
    _h("worker_start_seconds", "Seconds from an added worker's creation to serving: placement, model load "
       "and warm-up (after a scale to zero: the wake-up time).", REQUEST_BUCKETS_S),
    _h("time_to_first_token_seconds", "Seconds from arrival at the engine to the first token.",
       LATENCY_BUCKETS_S),
    _h("inter_token_latency_seconds", "Seconds between consecutive tokens of one sequence.",
       TOKEN_LATENCY_BUCKETS_S),
    _h("time_per_output_token_seconds", "Per request: seconds per token after the first "
       "(decode time / (tokens - 1)); requests with fewer than 2 tokens are not observed.",
       TOKEN_LATENCY_BUCKETS_S),
    _h("e2e_request_latency_seconds", "Seconds from arrival at the engine to the last token.",
       REQUEST_BUCKETS_S),
    _h("request_queue_time_seconds", "Seconds from arrival at the engine to first being scheduled.",
       REQUEST_BUCKETS_S),
    _h("engine_step_duration_seconds", "Seconds of one engine step (schedule, model, update).",
       STEP_BUCKETS_S, "worker"),
    _h("engine_step_batch_size", "Sequences given tokens in one engine step.", BATCH_SEQ_BUCKETS, "worker"),
    _h("engine_step_tokens", "Tokens computed in one engine step (the token budget used).",
       BATCH_TOKEN_BUCKETS, "worker"),
)


def prometheus_name(metric: MetricDef) -> str:
    """The family name in Prometheus text: counters get `_total`."""
    return metric.name + "_total" if metric.kind == "counter" else metric.name


class MetricsBackend(Protocol):
    def inc(self, name: str, value: float = 1.0, labels: tuple[str, ...] = ()) -> None: ...

    def set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None: ...

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None: ...


# --- the pure store ---------------------------------------------------------------------------
@dataclass(slots=True)
class HistogramValue:
    bucket_counts: list[int]  # per bucket (NOT cumulative); one more than buckets: the +Inf bucket
    sum: float = 0.0
    count: int = 0


@dataclass(frozen=True, slots=True)
class FamilySnapshot:
    """One metric's values at one moment: plain data, cheap to pickle across Ray."""

    metric: MetricDef
    values: dict[tuple[str, ...], float]  # counters and gauges: label values -> value
    histograms: dict[tuple[str, ...], HistogramValue] = field(default_factory=dict)  # label values -> value


class MetricStore:
    """Counters, gauges and fixed-bucket histograms in plain dicts; snapshot() copies them."""

    def __init__(self, metrics: Iterable[MetricDef]) -> None:
        self.metrics = {metric.name: metric for metric in metrics}
        self._values: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in self.metrics}
        self._histograms: dict[str, dict[tuple[str, ...], HistogramValue]] = {name: {} for name in self.metrics}

    def _check(self, name: str, kind: Kind, labels: tuple[str, ...]) -> MetricDef:
        metric = self.metrics[name]
        assert metric.kind == kind and len(labels) == len(metric.labels), (name, kind, labels)
        return metric

    def inc(self, name: str, value: float = 1.0, labels: tuple[str, ...] = ()) -> None:
        self._check(name, "counter", labels)
        assert value >= 0, (name, value)
        values = self._values[name]
        values[labels] = values.get(labels, 0.0) + value

    def set(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        self._check(name, "gauge", labels)
        self._values[name][labels] = float(value)

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        metric = self._check(name, "histogram", labels)
        histogram = self._histograms[name].get(labels)
        if histogram is None:
            histogram = self._histograms[name][labels] = HistogramValue([0] * (len(metric.buckets) + 1))
        histogram.bucket_counts[bisect.bisect_left(metric.buckets, value)] += 1  # le: value <= bound
        histogram.sum += value
        histogram.count += 1

    def declare(self, name: str, labels: tuple[str, ...] = ()) -> None:
        """Creates the series at 0 (an empty histogram) if it does not exist yet, so a fresh
        server lists every family with its label values before any traffic."""
        metric = self.metrics[name]
        assert len(labels) == len(metric.labels), (name, labels)
        if metric.kind == "histogram":
            if labels not in self._histograms[name]:
                self._histograms[name][labels] = HistogramValue([0] * (len(metric.buckets) + 1))
        else:
            self._values[name].setdefault(labels, 0.0)

    def value(self, name: str, labels: tuple[str, ...] = ()) -> float:
        return self._values[name].get(labels, 0.0)

    def histogram(self, name: str, labels: tuple[str, ...] = ()) -> HistogramValue | None:
        return self._histograms[name].get(labels)

    def snapshot(self) -> list[FamilySnapshot]:
        return [
            FamilySnapshot(
                metric,
                dict(self._values[name]),
                {labels: HistogramValue(list(h.bucket_counts), h.sum, h.count)
                 for labels, h in self._histograms[name].items()},
            )
            for name, metric in self.metrics.items()
        ]


# --- core stats -> metrics --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerState:
    """One worker's live state, read from its scheduler and runner (not from the last step)."""

    worker: str  # label
    alive: bool  # False: known dead
    num_running_seqs: int  # sequences in its running batch
    num_waiting_reqs: int  # requests queued
    num_kv_blocks_used: int  # blocks referenced by requests
    num_kv_blocks_total: int  # usable blocks
    num_steps: int = 0  # engine steps completed
    seconds_since_last_step: float | None = None  # None: never stepped
    busy_s: float = 0.0  # seconds a step of this worker was in flight (submitted, not returned)
    gap_s: float = 0.0  # seconds from a step's return to the next step's submission, back to back
    node_id: str | None = None  # the Ray node the worker runs on; None: not known yet
    node_ip: str | None = None
    state: str = "serving"  # starting | serving | draining (scheduler/engine_group.py)
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters the worker holds, least recently used first
    num_lora_loads: int = 0  # adapters loaded since start
    num_lora_evictions: int = 0  # adapters unloaded since start

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / max(1, self.num_kv_blocks_total)


@dataclass(frozen=True, slots=True)
class PublishedStats:
    """What a scheduler actor publishes for the ingress's /metrics and /v1/server_info."""

    families: list[FamilySnapshot]  # ENGINE_METRICS' values
    workers: list[WorkerState]
    status: object  # the actor's SchedulerStatus at the same moment
    lora_adapters: dict[str, str] = field(default_factory=dict)  # the adapters served now: name -> directory
    lora_version: int = 0  # run-time loads and unloads so far (a newer list replaces an older one)


_CUMULATIVE_COUNTERS = (  # CumulativeStats field -> counter (per worker)
    ("num_generation_tokens", PREFIX + "generation_tokens"),
    ("num_prompt_tokens_computed", PREFIX + "prompt_tokens_computed"),
    ("num_prefix_query_tokens", PREFIX + "prefix_cache_queries"),
    ("num_prefix_hit_tokens", PREFIX + "prefix_cache_hits"),
    ("num_preemptions", PREFIX + "preemptions"),
)


class EngineMetrics:
    """The StatsSink of a scheduler actor's engines: core stats objects -> every backend.

    Never raises into the engine: a failing backend is logged once and skipped.
    """

    def __init__(self, backends: Sequence[MetricsBackend]) -> None:
        self.backends = list(backends)
        self._published: dict[tuple[str, str], float] = {}  # (counter, worker or outcome) -> value sent
        self._failed: set[int] = set()  # id of backends that raised (logged once)

    # StatsSink
    def on_step(self, worker: str | None, step: StepStats, duration_s: float,
                inter_token_latencies_s: list[float]) -> None:
        labels = (worker or "0",)
        self._send("observe", PREFIX + "engine_step_duration_seconds", duration_s, labels)
        self._send("observe", PREFIX + "engine_step_batch_size", step.num_scheduled_seqs, labels)
        self._send("observe", PREFIX + "engine_step_tokens", step.num_scheduled_tokens, labels)
        for gap in inter_token_latencies_s:
            self._send("observe", PREFIX + "inter_token_latency_seconds", gap)
        for field_name, counter in _CUMULATIVE_COUNTERS:
            value = getattr(step, field_name)
            if value:
                self._send("inc", counter, value, labels)

    def on_request_finished(self, request: RequestStats) -> None:
        self._send("inc", PREFIX + "requests_finished", 1, (request.finish_reason,))
        self._send("inc", PREFIX + "prompt_tokens", request.num_prompt_tokens)
        self._send("observe", PREFIX + "e2e_request_latency_seconds", request.e2e_s)
        for name, value in (
            ("time_to_first_token_seconds", request.ttft_s),
            ("request_queue_time_seconds", request.queue_time_s),
            ("time_per_output_token_seconds", request.time_per_output_token_s),
        ):
            if value is not None:
                self._send("observe", PREFIX + name, value)

    def declare(self, worker_labels: Sequence[str]) -> None:
        """Every engine series at 0 in the backends that can hold a zero (MetricStore): per
        worker, per finish reason, per routing outcome. Ray's metrics cannot (a counter
        refuses 0); they appear there at the first value, and their gauges at the first refresh."""
        values_of = {"worker": list(worker_labels), "finish_reason": list(FINISH_REASONS),
                     "outcome": [outcome.value for outcome in RouteOutcome], "state": list(WORKER_STATES),
                     "result": ["hit", "load"], "lora_name": []}  # adapters appear with their first request
        for metric in ENGINE_METRICS:
            if metric.labels == ("direction", "reason"):
                label_sets = list(SCALE_EVENTS)
            else:
                assert len(metric.labels) <= 1, metric.name
                label_sets = [(value,) for value in values_of[metric.labels[0]]] if metric.labels else [()]
            for labels in label_sets:
                for backend in self.backends:
                    declare = getattr(backend, "declare", None)
                    if declare is not None:
                        declare(metric.name, labels)

    # state read at publish time
    def refresh_gauges(self, workers: Iterable[WorkerState]) -> None:
        for gauges in workers:
            labels = (gauges.worker,)
            self._send("set", PREFIX + "num_requests_running", gauges.num_running_seqs, labels)
            self._send("set", PREFIX + "num_requests_waiting", gauges.num_waiting_reqs, labels)
            self._send("set", PREFIX + "kv_cache_blocks_used", gauges.num_kv_blocks_used, labels)
            self._send("set", PREFIX + "kv_cache_blocks_capacity", gauges.num_kv_blocks_total, labels)
            self._send("set", PREFIX + "worker_alive", 1.0 if gauges.alive else 0.0, labels)
            self._send("set", PREFIX + "lora_adapters_loaded", len(gauges.lora_adapters), labels)
            self._publish_total(PREFIX + "lora_loads", gauges.worker, gauges.num_lora_loads)
            self._publish_total(PREFIX + "lora_evictions", gauges.worker, gauges.num_lora_evictions)

    def refresh_workers(self, workers: Iterable[WorkerState], desired: int) -> None:
        """Workers by state, and how many the autoscaling policy wants."""
        states = [worker.state for worker in workers]
        for state in WORKER_STATES:
            self._send("set", PREFIX + "workers", states.count(state), (state,))
        self._send("set", PREFIX + "workers_desired", desired)

    def on_scale_event(self, direction: str, reason: str) -> None:
        self._send("inc", PREFIX + "scale_events", 1, (direction, reason))

    def on_worker_started(self, seconds: float) -> None:
        self._send("observe", PREFIX + "worker_start_seconds", seconds)

    def publish_route_counts(self, route_counts: Mapping[str, int]) -> None:
        """The router's cumulative decisions by outcome, sent as increments."""
        for outcome, total in route_counts.items():
            self._publish_total(PREFIX + "routing_decisions", outcome, total)

    def publish_lora_counts(self, route_counts: Mapping[str, int], requests: Mapping[str, int],
                            generation_tokens: Mapping[str, int]) -> None:
        """Cumulative per-adapter counts (summed over the workers), sent as increments."""
        for result, total in route_counts.items():
            self._publish_total(PREFIX + "lora_routing_decisions", result, total)
        for name, total in requests.items():
            self._publish_total(PREFIX + "lora_requests", name, total)
        for name, total in generation_tokens.items():
            self._publish_total(PREFIX + "lora_generation_tokens", name, total)

    def _publish_total(self, counter: str, label: str, total: float) -> None:
        key = (counter, label)
        delta = total - self._published.get(key, 0.0)
        if delta > 0:
            self._published[key] = total
            self._send("inc", counter, delta, (label,))

    def _send(self, method: str, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        if isinstance(value, float) and math.isnan(value):
            return
        for backend in self.backends:
            try:
                getattr(backend, method)(name, value, labels)
            except Exception:
                if id(backend) not in self._failed:
                    self._failed.add(id(backend))
                    logger.exception("metrics backend %s failed on %s; its later errors are not logged",
                                     type(backend).__name__, name)

