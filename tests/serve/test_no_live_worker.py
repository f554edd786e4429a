"""No live worker in the scheduler is a 503 at the ingress."""

from __future__ import annotations

from ray.exceptions import RayTaskError

from serve_app.engine_client_ray import engine_error
from serve_app.errors import EngineUnavailableError
from scheduler.engine_group import NoLiveWorkerError


def test_no_live_worker_maps_to_503_directly_and_through_ray() -> None:
    cause = NoLiveWorkerError("none of the 2 workers is alive")
    direct = engine_error(cause)
    assert isinstance(direct, EngineUnavailableError) and direct.status == 503
    wrapped = RayTaskError("generate", "traceback", cause).as_instanceof_cause()
    through_ray = engine_error(wrapped)
    assert isinstance(through_ray, EngineUnavailableError) and through_ray.status == 503
    assert "no worker is alive" in str(through_ray)
