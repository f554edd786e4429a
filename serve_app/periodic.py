"""A coroutine run every few seconds on the replica's event loop, until stopped.

HealthMonitor keeps published state fresh this way (its poll also refreshes the
EngineStatsCache), so /health and /metrics answer from memory and never wait on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class PeriodicTask:
    def __init__(self, tick: Callable[[], Awaitable[None]], interval_s: float) -> None:
        self._tick = tick  # awaited once per period; it handles its own errors
        self._interval_s = interval_s  # seconds between the end of one tick and the next
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            await self._tick()
            await asyncio.sleep(self._interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
