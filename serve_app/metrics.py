"""The ingress's metrics: its own (HTTP, tokenization) and the engine's, as Prometheus text.

    ingress replica                                     scheduler actor(s)
      IngressMetrics -> MetricStore (+ RayMetrics)        EngineMetrics -> MetricStore (+ RayMetrics)
      EngineStatsCache  <-- published_stats(), refreshed by the HealthMonitor's poll (fetch_status)
      GET /metrics: render(ingress snapshot + cached engine snapshot)  (never calls the engine)

With N ingress replicas behind Serve's proxy, one /metrics answer shows the replica that
served it plus the engine's published metrics (the same on every replica). Prometheus
should scrape Ray's export instead (deploy/prometheus.yml): there every replica and the
scheduler appear once, as ray_rayllm_*. Engine metrics of several scheduler shards are
summed by label values (worker labels are unique across shards).

prometheus_client only formats text here: every value lives in a pure MetricStore.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from scheduler.metrics import (
    ENGINE_METRICS,
    PREFIX,
    REQUEST_BUCKETS_S,
    FamilySnapshot,
    HistogramValue,
    MetricDef,
    MetricsBackend,
    MetricStore,
    PublishedStats,
)
from serve_app.sharding import merge_statuses

logger = logging.getLogger(__name__)

TOKENIZER_OPS = ("encode", "encode_chat", "decode")  # TokenizerService's timed calls
TOKENIZE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# Recorded by each ingress replica.
INGRESS_METRICS: tuple[MetricDef, ...] = (
    MetricDef(PREFIX + "http_requests", "counter",
              "HTTP requests answered by this ingress, by route and status code.", ("route", "status_code")),
    MetricDef(PREFIX + "http_request_duration_seconds", "histogram",
              "Seconds from a request's arrival at the ingress to the end of its response (the whole "
              "stream for streaming responses).", ("route",), REQUEST_BUCKETS_S),
    MetricDef(PREFIX + "tokenization_seconds", "histogram",
              "Seconds of one tokenizer call on the tokenizer thread (encode, encode_chat, decode).",
              ("op",), TOKENIZE_BUCKETS_S),
)
# Computed when /metrics is rendered (ingress only, not in Ray's export).
ENGINE_STATS_AGE = MetricDef(PREFIX + "engine_stats_age_seconds", "gauge",
                             "Seconds since this ingress last received the engine's published metrics.")
ALL_METRICS: tuple[MetricDef, ...] = (*ENGINE_METRICS, *INGRESS_METRICS, ENGINE_STATS_AGE)


class IngressMetrics:
    """This replica's metrics: a MetricStore for /metrics plus optional backends (Ray)."""

    def __init__(self, extra_backends: Sequence[MetricsBackend] = ()) -> None:
        self.store = MetricStore(INGRESS_METRICS)
        self._backends: list[MetricsBackend] = [self.store, *extra_backends]

    def _send(self, method: str, name: str, value: float, labels: tuple[str, ...]) -> None:
        for backend in self._backends:
            try:
                getattr(backend, method)(name, value, labels)
            except Exception:  # metrics never break a request
                logger.debug("metrics backend %s failed on %s", type(backend).__name__, name, exc_info=True)

    def declare(self, generation_routes: Iterable[str]) -> None:
        """This replica's series at 0 before any traffic: requests answered 200 and their
        durations per generation route, each tokenizer op."""
        for route in generation_routes:
            self.store.declare(PREFIX + "http_requests", (route, "200"))
            self.store.declare(PREFIX + "http_request_duration_seconds", (route,))
        for op in TOKENIZER_OPS:
            self.store.declare(PREFIX + "tokenization_seconds", (op,))

    def observe_http(self, route: str, status_code: int, duration_s: float) -> None:
        self._send("inc", PREFIX + "http_requests", 1, (route, str(status_code)))
        self._send("observe", PREFIX + "http_request_duration_seconds", duration_s, (route,))

    def observe_tokenization(self, op: str, seconds: float) -> None:
        self._send("observe", PREFIX + "tokenization_seconds", seconds, (op,))


class EngineStatsCache:
    """The latest published stats of every scheduler shard. The ingress's HealthMonitor polls
    fetch_status(), so one call per shard and period refreshes /health, /metrics and
    /v1/server_info alike.

    Readers (/metrics, /v1/server_info) take `latest` and `text` as they are and never wait
    on a fetch. `text`, the engine's metrics in Prometheus text, is rendered once per refresh
    on a thread of its own (tens of ms for many workers), not per scrape on the event loop.
    """

    def __init__(
        self,
        fetchers: Sequence[Callable[[], Awaitable[PublishedStats]]],
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetchers = list(fetchers)  # one per shard
        self._timeout_s = timeout_s
        self._clock = clock
        self.latest: list[PublishedStats | None] = [None] * len(self._fetchers)  # by shard
        self._fetched_at: list[float | None] = [None] * len(self._fetchers)  # clock() per shard
        self.last_error: str | None = None
        self.text = b""  # the merged engine families of `latest`, in Prometheus text
        self._render_executor: ThreadPoolExecutor | None = None
        self.on_refresh: Callable[[list[PublishedStats | None]], None] | None = None  # after each refresh

    def age_s(self) -> float | None:
        """Seconds since the OLDEST shard's stats arrived; None before every shard answered."""
        if any(at is None for at in self._fetched_at) or not self._fetched_at:
            return None
        return self._clock() - min(at for at in self._fetched_at if at is not None)

    async def refresh(self) -> bool:
        """Fetches every shard's stats; False if any shard failed (last_error says why)."""
        results = await asyncio.gather(
            *(asyncio.wait_for(fetch(), self._timeout_s) for fetch in self._fetchers), return_exceptions=True
        )
        all_fresh = True
        for shard, result in enumerate(results):
            if isinstance(result, BaseException):
                self.last_error = f"shard {shard}: {type(result).__name__}: {result}"[:300]
                all_fresh = False
                continue
            self.latest[shard] = result
            self._fetched_at[shard] = self._clock()
        if self.on_refresh is not None:
            self.on_refresh(self.latest)
        published = [stats.families for stats in self.latest if stats is not None]
        if self._render_executor is None:
            self._render_executor = ThreadPoolExecutor(1, thread_name_prefix="metrics-render")
        loop = asyncio.get_running_loop()
        self.text = await loop.run_in_executor(self._render_executor, render_families, published)
        return all_fresh

    async def fetch_status(self) -> Any:
        """Refreshes, then the engine's status from the stats just published (every shard's
        merged): a HealthMonitor's fetch, so one call per shard and period serves /health,
        /metrics and /v1/server_info. Raises when a shard did not answer."""
        if not await self.refresh():
            raise RuntimeError(self.last_error)
        statuses = [stats.status for stats in self.latest if stats is not None]
        return statuses[0] if len(statuses) == 1 else merge_statuses(statuses)


# --- Prometheus text ------------------------------------------------------------------------
def merge_families(groups: Iterable[Sequence[FamilySnapshot]]) -> list[FamilySnapshot]:
    """Sums the same metric's values over several snapshots (scheduler shards), by labels."""
    merged: dict[str, FamilySnapshot] = {}
    for families in groups:
        for family in families:
            into = merged.get(family.metric.name)
            if into is None:
                merged[family.metric.name] = FamilySnapshot(
                    family.metric, dict(family.values),
                    {k: HistogramValue(list(h.bucket_counts), h.sum, h.count) for k, h in family.histograms.items()},
                )
                continue
            for labels, value in family.values.items():
                into.values[labels] = into.values.get(labels, 0.0) + value
            for labels, histogram in family.histograms.items():
                have = into.histograms.get(labels)
                if have is None:
                    into.histograms[labels] = HistogramValue(list(histogram.bucket_counts), histogram.sum,
                                                             histogram.count)
                    continue
                have.bucket_counts = [a + b for a, b in zip(have.bucket_counts, histogram.bucket_counts, strict=True)]
                have.sum += histogram.sum
                have.count += histogram.count
    return list(merged.values())


def to_prometheus(family: FamilySnapshot) -> Metric:
    metric = family.metric
    labels = list(metric.labels)
    if metric.kind == "counter":
        out: Metric = CounterMetricFamily(metric.name, metric.help, labels=labels)
    elif metric.kind == "gauge":
        out = GaugeMetricFamily(metric.name, metric.help, labels=labels)
    else:
        out = HistogramMetricFamily(metric.name, metric.help, labels=labels)
        for label_values, histogram in sorted(family.histograms.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*metric.buckets, float("inf")), histogram.bucket_counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            out.add_metric(list(label_values), buckets, histogram.sum)
        return out
    for label_values, value in sorted(family.values.items()):
        out.add_metric(list(label_values), value)
    return out


class _Families:
    """What generate_latest needs: an object whose collect() yields metric families."""

    def __init__(self, families: Iterable[FamilySnapshot]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield to_prometheus(family)


def render_families(groups: Sequence[Sequence[FamilySnapshot]]) -> bytes:
    """Prometheus text of several snapshots' families, merged (scheduler shards)."""
    return generate_latest(_Families(merge_families(groups)))  # type: ignore[arg-type]


def render(ingress: IngressMetrics, engine_stats: EngineStatsCache | None) -> tuple[bytes, str]:
    """The /metrics body and its content type: this replica's metrics, the engine stats'
    age, then the engine's metrics as last rendered (their families are disjoint)."""
    families = list(ingress.store.snapshot())
    engine_text = b""
    if engine_stats is not None:
        age = engine_stats.age_s()
        families.append(FamilySnapshot(ENGINE_STATS_AGE, {} if age is None else {(): age}))
        engine_text = engine_stats.text
    return generate_latest(_Families(families)) + engine_text, CONTENT_TYPE_LATEST  # type: ignore[arg-type]


def parse_families(text: str) -> dict[str, Any]:
    """Family name -> prometheus_client Metric, parsed from Prometheus text (tests, tools)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {family.name: family for family in text_string_to_metric_families(text)}
