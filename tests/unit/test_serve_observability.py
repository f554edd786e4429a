"""Request ids, the per-request log line, /metrics, /live and /v1/server_info, in-process
over the byte tokenizer and a scripted engine (no Ray)."""

from __future__ import annotations

import logging

import httpx
import pytest

from scheduler.metrics import ENGINE_METRICS, PREFIX, EngineMetrics, MetricStore, PublishedStats, WorkerState
from serve_app.api import create_api
from serve_app.metrics import EngineStatsCache, parse_families
from serve_app.observability import REQUEST_LOG, Observability
from serve_app.testing import ScriptedEngine, make_test_context

pytestmark = pytest.mark.anyio
COMPLETION = {"model": "test-model", "prompt": "hi", "max_tokens": 4}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def client_for(ctx) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_api(ctx)), base_url="http://test")


def sample(text: str, name: str, **labels: str) -> float:
    family = parse_families(text)[name]
    wanted = [s.value for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())
              and (s.name == name or s.name == name + "_total" or s.name == name + "_count")]
    assert wanted, (name, labels)
    return sum(wanted)


async def test_request_id_from_the_header_names_the_response_engine_request_and_log(caplog) -> None:
    engine = ScriptedEngine()
    ctx = make_test_context(engine)
    caplog.set_level(logging.INFO, logger=REQUEST_LOG.name)
    async with client_for(ctx) as client:
        response = await client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "abc-123"})
        assert response.status_code == 200
        assert response.headers.get_list("x-request-id") == ["abc-123"]
        assert response.json()["id"] == "cmpl-abc-123"
        assert engine.submitted[-1].request_id == "cmpl-abc-123"
        odd = await client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "a b\nc"})
        assert odd.headers["x-request-id"] == "a_b_c" and odd.json()["id"] == "cmpl-a_b_c"
        generated = await client.post("/v1/completions", json=COMPLETION)
        assert len(generated.headers["x-request-id"]) == 32
    lines = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOG.name]
    assert len(lines) == 3
    assert lines[0].startswith("request finished: id=abc-123 route=/v1/completions status=200 finish=length ")
    assert "prompt_tokens=2 output_tokens=4 cached_tokens=0 ttft=" in lines[0]  # "hi": 2 byte tokens
    assert " total=" in lines[0] and lines[0].endswith("worker=-")


async def test_failed_requests_are_logged_and_counted_by_status(caplog) -> None:
    ctx = make_test_context()
    caplog.set_level(logging.INFO, logger=REQUEST_LOG.name)
    async with client_for(ctx) as client:
        bad = await client.post("/v1/completions", json={**COMPLETION, "model": "nope"},
                                headers={"x-request-id": "bad-1"})
        assert bad.status_code in (400, 404)
        assert (await client.get("/nowhere")).status_code == 404
        assert (await client.get("/live")).json() == {"status": "alive"}
        text = (await client.get("/metrics")).text
    lines = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOG.name]
    assert len(lines) == 1 and f"id=bad-1 route=/v1/completions status={bad.status_code} finish=-" in lines[0]
    assert sample(text, PREFIX + "http_requests", route="/v1/completions", status_code=str(bad.status_code)) == 1
    assert sample(text, PREFIX + "http_requests", route="other", status_code="404") == 1
    assert sample(text, PREFIX + "http_requests", route="/live", status_code="200") == 1


async def test_metrics_show_tokenization_and_engine_stats_from_the_cache() -> None:
    store = MetricStore(ENGINE_METRICS)
    workers = [WorkerState("0", True, 2, 1, 10, 100, num_steps=7, node_id="n1", node_ip="127.0.0.1",
                           lora_adapters=("b", "a"), num_lora_loads=3, num_lora_evictions=1)]
    EngineMetrics([store]).refresh_gauges(workers)

    async def fetch() -> PublishedStats:
        return PublishedStats(store.snapshot(), workers, None)

    cache = EngineStatsCache([fetch])
    await cache.refresh()
    ctx = make_test_context()
    ctx.observability = Observability(engine_stats=cache)
    async with client_for(ctx) as client:
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        response = await client.get("/metrics")
        info = (await client.get("/v1/server_info")).json()
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert sample(text, PREFIX + "tokenization_seconds", op="encode") == 1
    assert sample(text, PREFIX + "num_requests_running", worker="0") == 2
    assert sample(text, PREFIX + "kv_cache_blocks_used", worker="0") == 10
    assert 0 <= sample(text, PREFIX + "engine_stats_age_seconds") < 60
    [worker] = info["schedulers"][0]["workers"]
    assert worker == {
        "worker": "0", "state": "busy", "lifecycle": "serving", "node_id": "n1", "node_ip": "127.0.0.1", "num_running": 2,
        "num_waiting": 1, "kv_blocks_used": 10, "kv_blocks_total": 100, "kv_usage": 0.1, "num_steps": 7,
        "seconds_since_last_step": None, "busy_s": 0.0, "gap_s": 0.0,
        "lora_adapters": ["b", "a"], "lora_loads": 3, "lora_evictions": 1,
    }
    assert info["model"] == "test-model"


async def test_server_info_reports_the_replicas_data_plane_verdict() -> None:
    ctx = make_test_context()
    async with client_for(ctx) as client:
        assert (await client.get("/v1/server_info")).json()["fast_data_plane"] is None  # not checked in-process
    ctx.fast_data_plane = {"enabled": False, "missing": ["RAY_SERVE_THROUGHPUT_OPTIMIZED=1"]}
    async with client_for(ctx) as client:
        info = (await client.get("/v1/server_info")).json()
    assert info["fast_data_plane"] == {"enabled": False, "missing": ["RAY_SERVE_THROUGHPUT_OPTIMIZED=1"]}


async def test_an_unreachable_engine_keeps_the_last_stats_and_reports_the_error() -> None:
    calls = {"n": 0}

    async def flaky() -> PublishedStats:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("scheduler gone")
        return PublishedStats(MetricStore(ENGINE_METRICS).snapshot(), [], None)

    cache = EngineStatsCache([flaky])
    await cache.refresh()
    first = cache.latest[0]
    await cache.refresh()
    assert cache.latest[0] is first and "scheduler gone" in (cache.last_error or "")


async def test_an_open_request_with_no_worker_work_pending_is_not_a_stuck_engine() -> None:
    """A request whose last delta is not read yet (or is queued for admission) has no
    pending step: seconds_since_last_step is None and /health stays ready."""
    from dataclasses import dataclass

    from serve_app.health import HealthConfig, HealthMonitor

    @dataclass
    class Status:
        num_workers: int = 1
        num_live_workers: int = 1
        num_running: int = 0
        num_waiting: int = 0
        num_unfinished_requests: int = 1
        seconds_since_last_step: float | None = None

    async def fetch() -> Status:
        return Status()

    monitor = HealthMonitor(fetch, HealthConfig(step_deadline_s=1.0))
    await monitor.poll_once()
    assert monitor.readiness().ready
