"""EngineClient over the SchedulerActor: the ingress's only Ray-facing piece for requests.

Errors become OpenAI errors: a request the scheduler refuses (ValueError) is a 400, a dead
or restarting actor is a 503, anything else from the engine a 500. Nothing here blocks
the event loop: every call is awaited or fire-and-forget.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from serve_app.engine_client import EngineStatus
from serve_app.errors import EngineUnavailableError, OpenAIError
from scheduler.actor import is_actor_death
from scheduler.outputs import EngineRequest, RequestOutput


def engine_error(error: Exception) -> OpenAIError:
    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    if isinstance(cause, ValueError):
        return OpenAIError(f"the engine refused the request: {cause}", 400, code="invalid_request")
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
