"""Readiness rules (HealthMonitor with a fake clock) and the up-front resource plan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import pydantic
import pytest

from serve_app.config import AppArgs, ResourceError, plan_resources
from serve_app.health import HealthConfig, HealthMonitor


@dataclass(frozen=True)
class Status:
    num_workers: int = 2
    num_live_workers: int = 2
    num_running: int = 0
    num_waiting: int = 0
    num_unfinished_requests: int = 0
    seconds_since_last_step: float | None = None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def monitor_with(statuses: list, clock: Clock) -> HealthMonitor:
    async def fetch():
        item = statuses.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    return HealthMonitor(fetch, HealthConfig(stale_after_s=5.0, step_deadline_s=30.0), clock)


def poll(monitor: HealthMonitor) -> None:
    asyncio.run(monitor.poll_once())


def test_not_ready_before_the_first_status_and_ready_after() -> None:
    clock = Clock()
    monitor = monitor_with([RuntimeError("actor died"), Status()], clock)
    poll(monitor)
    report = monitor.readiness()
    assert not report.ready and "actor died" in report.reason
    poll(monitor)
    assert monitor.readiness().ready


def test_stale_status_means_the_scheduler_is_unreachable() -> None:
    clock = Clock()
    monitor = monitor_with([Status(), TimeoutError("slow")], clock)
    poll(monitor)
    clock.now += 6.0
    poll(monitor)
    report = monitor.readiness()
    assert not report.ready and "unreachable" in report.reason


def test_no_live_worker_is_not_ready() -> None:
    monitor = monitor_with([Status(num_live_workers=0)], Clock())
    poll(monitor)
    assert "no live workers" in monitor.readiness().reason


def test_pending_work_without_a_step_past_the_deadline_is_stuck() -> None:
    clock = Clock()
    busy = Status(num_running=3, num_unfinished_requests=3, seconds_since_last_step=1.0)
    monitor = monitor_with([busy, replace(busy, seconds_since_last_step=31.0)], clock)
    poll(monitor)
    assert monitor.readiness().ready
    clock.now += 4.0  # the snapshot ages: 1 + 4 s is still within the deadline
    assert monitor.readiness().ready
    poll(monitor)
    report = monitor.readiness()
    assert not report.ready and "stuck" in report.reason


def test_idle_engine_is_ready_however_long_since_a_step() -> None:
    monitor = monitor_with([Status(seconds_since_last_step=None)], Clock())
    poll(monitor)
    assert monitor.readiness().ready


def test_resource_plan_fits_or_says_what_to_change() -> None:
    plan = plan_resources(AppArgs(num_workers=2, worker_num_cpus=1.5), {"CPU": 4.0})
    assert (plan.worker_num_cpus, plan.worker_num_gpus, plan.worker_num_threads) == (1.5, 0, 1)
    assert plan.total_cpus == pytest.approx(3.5)
    with pytest.raises(ResourceError, match="needs 5.5 CPUs .* cluster has 4"):
        plan_resources(AppArgs(num_workers=5, worker_num_cpus=1), {"CPU": 4.0})
    with pytest.raises(ResourceError, match="GPUs"):
        plan_resources(AppArgs(worker_device="cuda"), {"CPU": 8.0})


def test_resource_plan_uses_gpus_when_every_worker_gets_one() -> None:
    assert plan_resources(AppArgs(num_workers=2), {"CPU": 4.0, "GPU": 2.0}).worker_num_gpus == 1
    assert plan_resources(AppArgs(num_workers=3), {"CPU": 4.0, "GPU": 2.0}).worker_num_gpus == 0
    assert plan_resources(AppArgs(worker_device="cpu"), {"CPU": 4.0, "GPU": 2.0}).worker_num_gpus == 0


def test_app_args_validate_and_accept_cli_strings() -> None:
    args = AppArgs.model_validate({"num_workers": "2", "kv_cache_memory_gb": "0.5"})
    assert args.num_workers == 2 and args.kv_cache_memory_bytes == 1 << 29
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate({"num_workers": 0})
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate({"num_wokers": 2})  # a typo is an error, not a silent default


def test_scheduler_config_carries_the_knobs_and_unchunked_budget_holds_a_whole_prompt() -> None:
    default = AppArgs().scheduler_config(block_size=16, num_blocks=600, max_model_len=8192)
    assert default.enable_prefix_caching and default.enable_chunked_prefill
    assert default.max_num_batched_tokens == 2048
    off = AppArgs.model_validate({"enable_chunked_prefill": False, "enable_prefix_caching": False})
    config = off.scheduler_config(block_size=16, num_blocks=600, max_model_len=8192)
    assert not config.enable_chunked_prefill and not config.enable_prefix_caching
    # vLLM's rule: without chunking, one step must hold the longest prompt
    assert config.max_num_batched_tokens == 8192
    bigger = AppArgs.model_validate({"enable_chunked_prefill": False, "max_num_batched_tokens": 10000})
    assert bigger.scheduler_config(block_size=16, num_blocks=600, max_model_len=8192).max_num_batched_tokens == 10000


def test_long_prefill_threshold_reaches_the_scheduler() -> None:
    assert AppArgs().scheduler_config(block_size=16, num_blocks=600, max_model_len=8192).long_prefill_token_threshold == 512
    capped = AppArgs.model_validate({"max_num_batched_tokens": 2048, "long_prefill_token_threshold": 256})
    config = capped.scheduler_config(block_size=16, num_blocks=600, max_model_len=8192)
    assert (config.max_num_batched_tokens, config.long_prefill_token_threshold) == (2048, 256)
    unchunked = AppArgs.model_validate({"long_prefill_token_threshold": None})
    assert unchunked.scheduler_config(block_size=16, num_blocks=600, max_model_len=8192).long_prefill_token_threshold is None
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate({"long_prefill_token_threshold": 0})


def test_prefill_cap_while_decoding_reaches_the_scheduler() -> None:
    sizes = {"block_size": 16, "num_blocks": 600, "max_model_len": 8192}
    assert AppArgs().scheduler_config(**sizes).max_prefill_tokens_while_decoding is None
    capped = AppArgs.model_validate({"max_prefill_tokens_while_decoding": 128, "waiting_served_ratio": 0})
    config = capped.scheduler_config(**sizes)
    assert (config.max_prefill_tokens_while_decoding, config.waiting_served_ratio) == (128, 0)
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate({"max_prefill_tokens_while_decoding": 0})


def test_long_prompt_chunk_while_decoding_reaches_the_scheduler() -> None:
    sizes = {"block_size": 16, "num_blocks": 600, "max_model_len": 8192}
    assert AppArgs().scheduler_config(**sizes).long_prefill_tokens_while_decoding == 128
    off = AppArgs.model_validate({"long_prefill_tokens_while_decoding": None}).scheduler_config(**sizes)
    assert off.long_prefill_tokens_while_decoding is None
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate({"long_prefill_tokens_while_decoding": 0})


def test_async_scheduling_is_on_by_default_and_can_be_turned_off() -> None:
    sizes = {"block_size": 16, "num_blocks": 600, "max_model_len": 8192}
    assert AppArgs().scheduler_config(**sizes).async_scheduling
    assert not AppArgs.model_validate({"async_scheduling": False}).scheduler_config(**sizes).async_scheduling


def test_prefill_batching_is_on_by_default_and_reaches_the_scheduler() -> None:
    sizes = {"block_size": 16, "num_blocks": 600, "max_model_len": 8192}
    shipped = AppArgs().scheduler_config(**sizes)
    assert (shipped.waiting_served_ratio, shipped.max_waiting_steps, shipped.hold_while_finishing_steps) == (0.3, 20, 4)
    off = AppArgs.model_validate({"waiting_served_ratio": 0, "max_waiting_steps": 5,
                                  "hold_while_finishing_steps": 0}).scheduler_config(**sizes)
    assert (off.waiting_served_ratio, off.max_waiting_steps, off.hold_while_finishing_steps) == (0.0, 5, 0)
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate({"waiting_served_ratio": -1})


def test_waiting_for_a_shared_prefix_is_on_by_default_and_reaches_the_scheduler() -> None:
    sizes = {"block_size": 16, "num_blocks": 600, "max_model_len": 8192}
    assert AppArgs().scheduler_config(**sizes).min_shared_prefix_to_wait == 256
    assert AppArgs.model_validate({"min_shared_prefix_to_wait": None}).scheduler_config(**sizes).min_shared_prefix_to_wait is None
    with pytest.raises(pydantic.ValidationError):
        AppArgs.model_validate({"min_shared_prefix_to_wait": 0})
