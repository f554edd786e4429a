"""Readiness from published engine status: instant to answer, truthful about the engine.

A background task polls the engine's cheap status() every poll_interval_s (the scheduler
answers it from its own loop, never waiting on a step). /health reads the last snapshot,
so it never waits on the engine. It is NOT ready when:

- no status has arrived within stale_after_s (scheduler dead, restarting or wedged);
- no worker is alive;
- work is pending and no engine step completed within step_deadline_s (a stuck step).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from serve_app.engine_client import EngineStatus
from serve_app.periodic import PeriodicTask

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    poll_interval_s: float = 0.5  # between status calls
    status_timeout_s: float = 2.0  # a status call slower than this is a failed poll
    stale_after_s: float = 5.0  # no status for this long: the scheduler is unreachable
    step_deadline_s: float = 60.0  # pending work and no step for this long: the engine is stuck


@dataclass(frozen=True, slots=True)
class HealthReport:
    ready: bool
    reason: str  # "ok", or why not
    status: EngineStatus | None  # the snapshot the verdict came from


class HealthMonitor:
    def __init__(
        self,
        fetch_status: Callable[[], Awaitable[EngineStatus]],
        config: HealthConfig = HealthConfig(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch_status = fetch_status
        self._config = config
        self._clock = clock
        self._status: EngineStatus | None = None
        self._status_time: float | None = None  # clock() when _status arrived
        self._last_error = "no status received yet"
        self._poller = PeriodicTask(self.poll_once, self._config.poll_interval_s)

    async def poll_once(self) -> None:
        try:
            status = await asyncio.wait_for(self._fetch_status(), self._config.status_timeout_s)
        except Exception as error:  # a dead actor, a timeout: recorded, reported by readiness()
            self._last_error = f"{type(error).__name__}: {error}"[:300]
            return
        self._status = status
        self._status_time = self._clock()

    def start(self) -> None:
        self._poller.start()

    async def stop(self) -> None:
        await self._poller.stop()

    def readiness(self) -> HealthReport:
        status, status_time = self._status, self._status_time
        if status is None or status_time is None:
            return HealthReport(False, f"engine status unavailable ({self._last_error})", None)
        age = self._clock() - status_time
        if age > self._config.stale_after_s:
            reason = f"scheduler unreachable: last status {age:.1f}s ago ({self._last_error})"
            return HealthReport(False, reason, status)
        if getattr(status, "draining", False):
            return HealthReport(False, "the engine is draining for shutdown", status)
        if status.num_live_workers == 0 and not getattr(status, "can_wake", False):
            return HealthReport(False, f"no live workers (0 of {status.num_workers})", status)
        # seconds_since_last_step is None when no worker has work pending (it counts from the
        # later of the last step's end and the moment work arrived): nothing can be stuck then,
        # even if a request is still open (its last delta not yet read, or queued for admission).
        since_step = status.seconds_since_last_step
        if status.num_unfinished_requests > 0 and since_step is not None:
            if since_step + age > self._config.step_deadline_s:
                reason = (
                    f"engine stuck: {status.num_unfinished_requests} requests pending and no step "
                    f"completed for {since_step + age:.1f}s (deadline {self._config.step_deadline_s}s)"
                )
                return HealthReport(False, reason, status)
        return HealthReport(True, "ok", status)
