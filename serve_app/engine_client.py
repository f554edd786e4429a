"""The ingress's view of the engine: submit token ids, get deltas, abort, read status.

The routes depend only on this protocol, so tests inject an in-process engine (or a
scripted fake) and the Ray deployment injects RayEngineClient (engine_client_ray.py).
ResumingEngineClient (resume.py) wraps the Ray client to resubmit after a scheduler restart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from serve_app.errors import OpenAIError, draining_error, queue_full_error
from scheduler.admission import DrainingError, QueueFullError
from scheduler.outputs import EngineRequest, RequestOutput


class EngineStatus(Protocol):
    """What /health reads; SchedulerActor.status() returns one (scheduler/actor.py)."""

    num_workers: int  # worker actors configured
    num_live_workers: int  # of those, answering
    num_running: int  # sequences in running batches
    num_waiting: int  # requests queued
    num_unfinished_requests: int  # requests the engine still owes output to
    seconds_since_last_step: float | None  # since the last completed step; None if none yet


class EngineClient(Protocol):
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Deltas of every sequence of the request, until each has finished."""
        ...

    def abort(self, request_id: str) -> None:
        """Fire and forget (callable from a finally block of a cancelled task)."""
        ...

    async def status(self) -> EngineStatus: ...


class InProcessEngineClient:
    """Adapts an in-process engine (scheduler.engine.Engine, or a fake with the same
    add_request/abort methods) to EngineClient; used by tests and benchmarks."""

    def __init__(self, engine: Any, status_fn: Any = None) -> None:
        self._engine = engine
        self._status_fn = status_fn

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        try:
            stream = self._engine.add_request(request)
        except ValueError as error:  # the engine can never run it
            raise OpenAIError(f"the engine refused the request: {error}", 400, code="invalid_request") from None
        except QueueFullError as error:  # an EngineGroup's admission
            raise queue_full_error(str(error), error.retry_after_s) from None
        except DrainingError:
            raise draining_error() from None
        try:
            async for output in stream:
                yield output
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()

    def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)

    async def status(self) -> EngineStatus:
        if self._status_fn is None:
            raise NotImplementedError("this engine publishes no status")
        return self._status_fn()
