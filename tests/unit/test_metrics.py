"""Core stats -> metrics (EngineMetrics over an in-process Engine), the pure MetricStore, and
the Prometheus text the ingress renders from it. No Ray."""

from __future__ import annotations

import asyncio
import itertools

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.metrics import (
    ENGINE_METRICS,
    PREFIX,
    EngineMetrics,
    MetricDef,
    MetricStore,
    PublishedStats,
    WorkerState,
)
from scheduler.outputs import EngineRequest, FinishReason
from scheduler.sampling_params import SamplingParams
from scheduler.stats import StepStats
from scheduler.testing import FakeRunner
from serve_app.metrics import ALL_METRICS, EngineStatsCache, IngressMetrics, parse_families, render

CFG = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=128, max_num_batched_tokens=32)
REQUEST_HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "time_per_output_token_seconds")


class StepClock:
    """A clock that moves 10 ms per reading: every latency is positive and finite."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def __call__(self) -> float:
        return next(self._ticks) * 0.01


def make_engine() -> tuple[Engine, MetricStore, EngineMetrics]:
    store = MetricStore(ENGINE_METRICS)
    metrics = EngineMetrics([store])
    engine = Engine(CFG, FakeRunner(CFG.block_size, CFG.num_blocks), clock=StepClock(),
                    stats_sink=metrics, worker_label="0")
    return engine, store, metrics


def gauges_of(engine: Engine) -> WorkerState:
    load = engine.scheduler.load()
    return WorkerState("0", True, load.num_running_seqs, load.num_waiting_reqs,
                       load.num_usable_blocks - load.num_free_blocks, load.num_usable_blocks)


def count(store: MetricStore, name: str, labels: tuple[str, ...] = ()) -> int:
    histogram = store.histogram(PREFIX + name, labels)
    return 0 if histogram is None else histogram.count


def test_k_requests_of_m_tokens_give_consistent_counts_and_gauges_return_to_zero() -> None:
    k, m = 5, 7
    engine, store, metrics = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
    prompts = [list(range(10 * i, 10 * i + 5)) for i in range(k)]
    results = engine.generate(prompts, params)
    assert all(len(r.sequences[0].token_ids) == m for r in results)
    for name in REQUEST_HISTOGRAMS:
        assert count(store, name) == k, name
    assert count(store, "inter_token_latency_seconds") == k * (m - 1)
    assert store.value(PREFIX + "generation_tokens", ("0",)) == k * m
    assert store.value(PREFIX + "prompt_tokens") == k * 5
    assert store.value(PREFIX + "requests_finished", ("length",)) == k
    assert store.value(PREFIX + "prefix_cache_queries", ("0",)) == k * 5
    steps = count(store, "engine_step_duration_seconds", ("0",))
    assert steps == engine.stats.num_steps > 0
    batch = store.histogram(PREFIX + "engine_step_batch_size", ("0",))
    assert batch is not None and batch.count == steps and batch.sum >= k * m  # every token was a scheduled seq
    tokens = store.histogram(PREFIX + "engine_step_tokens", ("0",))
    assert tokens is not None and tokens.sum == engine.stats.num_scheduled_tokens
    # latencies follow the engine clock: TTFT <= e2e, queue <= TTFT for every request
    ttft = store.histogram(PREFIX + "time_to_first_token_seconds")
    e2e = store.histogram(PREFIX + "e2e_request_latency_seconds")
    queue = store.histogram(PREFIX + "request_queue_time_seconds")
    assert 0 < queue.sum <= ttft.sum < e2e.sum
    metrics.refresh_gauges([gauges_of(engine)])
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"):
        assert store.value(PREFIX + name, ("0",)) == 0, name
    assert store.value(PREFIX + "kv_cache_blocks_capacity", ("0",)) == CFG.num_blocks - 1


def test_aborted_requests_count_as_abort_and_free_the_gauges() -> None:
    engine, store, metrics = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def main() -> None:
        streams = [engine.add_request(EngineRequest(f"r{i}", [1, 2, 3, 4, 5, 6], params)) for i in range(3)]
        firsts = [await anext(stream) for stream in streams]  # the engine's own loop steps them
        assert all(first.new_token_ids and not first.finished for first in firsts)
        metrics.refresh_gauges([gauges_of(engine)])
        assert store.value(PREFIX + "num_requests_running", ("0",)) == 3
        assert store.value(PREFIX + "kv_cache_blocks_used", ("0",)) > 0
        for i in range(3):
            engine.abort(f"r{i}")
        for stream in streams:
            deltas = [d async for d in stream]
            assert deltas, "the abort's final delta"
            assert deltas[-1].finish_reason is FinishReason.ABORT

    asyncio.run(main())
    assert store.value(PREFIX + "requests_finished", ("abort",)) == 3
    assert count(store, "e2e_request_latency_seconds") == 3
    metrics.refresh_gauges([gauges_of(engine)])
    assert store.value(PREFIX + "num_requests_running", ("0",)) == 0
    assert store.value(PREFIX + "kv_cache_blocks_used", ("0",)) == 0


def test_n_choices_count_once_with_their_common_reason_and_outputs_name_the_worker() -> None:
    engine, store, _ = make_engine()
    results = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(n=3, max_tokens=4, ignore_eos=True, seed=1))
    assert [len(s.token_ids) for s in results[0].sequences] == [4, 4, 4]
    assert store.value(PREFIX + "requests_finished", ("length",)) == 1
    assert store.value(PREFIX + "generation_tokens", ("0",)) == 12
    assert count(store, "time_per_output_token_seconds") == 1

    async def first_output():
        stream = engine.add_request(EngineRequest("w", [1, 2, 3], SamplingParams(max_tokens=1)))
        return [d async for d in stream][0]

    assert asyncio.run(first_output()).worker == "0"


def test_route_counts_are_published_as_increments() -> None:
    store = MetricStore(ENGINE_METRICS)
    metrics = EngineMetrics([store])
    metrics.publish_route_counts({"prefix_hit": 2, "no_match_most_free": 1})
    metrics.publish_route_counts({"prefix_hit": 5, "no_match_most_free": 1})
    assert store.value(PREFIX + "routing_decisions", ("prefix_hit",)) == 5
    assert store.value(PREFIX + "routing_decisions", ("no_match_most_free",)) == 1


def test_a_failing_backend_never_reaches_the_engine() -> None:
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("backend down")

    store = MetricStore(ENGINE_METRICS)
    engine = Engine(CFG, FakeRunner(CFG.block_size, CFG.num_blocks), stats_sink=EngineMetrics([Broken(), store]))
    results = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(results[0].sequences[0].token_ids) == 3
    assert store.value(PREFIX + "generation_tokens", ("0",)) == 3


def test_histogram_buckets_are_le_and_render_cumulative_with_total_suffixes() -> None:
    metric = MetricDef(PREFIX + "x_seconds", "histogram", "x.", ("op",), (0.1, 1.0))
    counter = MetricDef(PREFIX + "things", "counter", "things.", ("kind",))
    store = MetricStore([metric, counter])
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        store.observe(metric.name, value, ("a",))
    store.inc(counter.name, 2, ("b",))
    assert store.histogram(metric.name, ("a",)).bucket_counts == [2, 2, 1]
    text = render_shards(store.snapshot(), store.snapshot())  # two shards: summed
    assert f'{PREFIX}x_seconds_bucket{{le="0.1",op="a"}} 4.0' in text
    assert f'{PREFIX}x_seconds_bucket{{le="1.0",op="a"}} 8.0' in text
    assert f'{PREFIX}x_seconds_bucket{{le="+Inf",op="a"}} 10.0' in text
    assert f'{PREFIX}x_seconds_count{{op="a"}} 10.0' in text
    assert f'{PREFIX}things_total{{kind="b"}} 4.0' in text
    assert f"# HELP {PREFIX}things_total things." in text


def render_shards(*shards) -> str:
    """/metrics text with each of `shards` (families) as one scheduler shard's publication."""

    def fetcher(families):
        async def fetch() -> PublishedStats:
            return PublishedStats(families, [], None)
        return fetch

    cache = EngineStatsCache([fetcher(families) for families in shards])
    asyncio.run(cache.refresh())
    body, content_type = render(IngressMetrics(), cache)
    assert content_type.startswith("text/plain")
    return body.decode()


def test_every_metric_has_the_prefix_help_and_a_unique_name() -> None:
    names = [metric.name for metric in ALL_METRICS]
    assert len(names) == len(set(names))
    for metric in ALL_METRICS:
        assert metric.name.startswith("rayllm_") and metric.help.endswith((".", ")")), metric
    store = MetricStore(ENGINE_METRICS)
    text = render_shards(store.snapshot())
    parsed = parse_families(text)
    assert {metric.name for metric in ALL_METRICS} <= set(parsed)


def test_declared_series_exist_at_zero_for_every_family_and_label_value() -> None:
    """A fresh server lists every family with its label values before any traffic."""
    from scheduler.metrics import FINISH_REASONS
    from scheduler.router import RouteOutcome
    from serve_app.metrics import TOKENIZER_OPS

    store = MetricStore(ENGINE_METRICS)
    metrics = EngineMetrics([store])
    metrics.declare(["0", "1"])
    ingress = IngressMetrics()
    ingress.declare(["/v1/completions", "/v1/chat/completions"])
    text = render(ingress, None)[0].decode() + render_engine(store)
    families = parse_families(text)
    for metric in ALL_METRICS:
        if metric.name == PREFIX + "engine_stats_age_seconds":
            continue  # computed at render time, from the engine stats' age
        if metric.labels == ("lora_name",):
            continue  # one series per adapter, from its first request (adapters come and go at run time)
        family = families[metric.name]
        assert family.samples, metric.name
        assert all(sample.value == 0 for sample in family.samples), metric.name
        label_values = {tuple(s.labels.get(k) for k in metric.labels) for s in family.samples}
        expected = {"worker": {"0", "1"}, "finish_reason": set(FINISH_REASONS),
                    "outcome": {o.value for o in RouteOutcome}, "op": set(TOKENIZER_OPS),
                    "route": {"/v1/completions", "/v1/chat/completions"}, "status_code": {"200"},
                    "state": {"starting", "serving", "draining"}, "direction": {"up", "down"},
                    "reason": {"queue", "kv", "latency", "wake", "min", "idle", "max"}, "result": {"hit", "load"}}
        for position, label in enumerate(metric.labels):
            assert {values[position] for values in label_values} == expected[label], (metric.name, label)
    # recording after a declaration adds to the same series
    metrics.on_step("1", StepStats(step=1, num_scheduled_seqs=3, num_scheduled_tokens=9, num_generation_tokens=3),
                    0.5, [0.1])
    assert store.value(PREFIX + "generation_tokens", ("1",)) == 3
    assert store.histogram(PREFIX + "engine_step_duration_seconds", ("1",)).count == 1
    assert store.histogram(PREFIX + "engine_step_duration_seconds", ("0",)).count == 0


def render_engine(store: MetricStore) -> str:
    from serve_app.metrics import render_families

    return render_families([store.snapshot()]).decode()
