"""EngineClient over the SchedulerActor: the ingress's only Ray-facing piece for requests.

Errors become OpenAI errors: a request the scheduler refuses (ValueError) is a 400, a dead
or restarting actor is a 503, anything else from the engine a 500. Nothing here blocks
the event loop: every call is awaited or fire-and-forget.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from serve_app.engine_client import EngineStatus
from serve_app.errors import (
    EngineUnavailableError,
    OpenAIError,
    SchedulerGoneError,
    draining_error,
    queue_full_error,
)
from scheduler.admission import DrainingError, QueueFullError
from scheduler.actor import is_actor_death
from scheduler.engine_group import NoLiveWorkerError
from scheduler.outputs import EngineRequest, RequestOutput


def engine_error(error: Exception) -> OpenAIError:
    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    if isinstance(cause, ValueError):
        return OpenAIError(f"the engine refused the request: {cause}", 400, code="invalid_request")
    if isinstance(cause, NoLiveWorkerError):
        return EngineUnavailableError(f"no worker is alive ({cause}); retry later")
    if isinstance(cause, QueueFullError):
        return queue_full_error(str(cause), cause.retry_after_s)
    if isinstance(cause, DrainingError):
        return draining_error()
    if isinstance(error, RayActorError) and not isinstance(error, RayTaskError):
        # The scheduler actor itself died or is restarting (a RayTaskError would be an error
        # its code raised): the request may be resubmitted (serve_app/resume.py).
        return SchedulerGoneError(f"the scheduler is unavailable ({type(error).__name__}); retry later")
    if is_actor_death(cause) or isinstance(error, RayActorError):
        return EngineUnavailableError(f"the engine is unavailable ({type(cause).__name__}); retry later")
    return OpenAIError(f"engine error: {type(cause).__name__}: {cause}"[:500], 500, error_type="server_error")


class RayEngineClient:
    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler  # ActorHandle of SchedulerActor

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        try:
            refs = self._scheduler.generate.remote(request)
            async for ref in refs:
                batch: list[RequestOutput] = await ref
                for output in batch:
                    yield output
        except OpenAIError:
            raise
        except (RayTaskError, RayActorError) as error:
            raise engine_error(error) from None

    def abort(self, request_id: str) -> None:
        try:
            self._scheduler.abort.remote(request_id)
        except Exception:  # the actor is gone: nothing left to free
            pass

    async def status(self) -> EngineStatus:
        return await self._scheduler.status.remote()

    async def wait_ready(self, timeout_s: float) -> None:
        """Returns once the scheduler answers again (Ray restarts a dead one, max_restarts);
        EngineUnavailableError if it does not within timeout_s."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(self._scheduler.ready.remote(), min(remaining, 5.0))
                return
            except asyncio.TimeoutError:
                continue
            except Exception:  # dead or restarting: ask again shortly
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        raise EngineUnavailableError(f"the scheduler did not come back within {timeout_s:g}s; retry later")
