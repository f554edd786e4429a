"""Worker sizing: torch threads follow reserved CPUs unless the app sets them explicitly."""

from serve_app.config import AppArgs
from workers.actor import WorkerResources


def test_threads_default_to_floor_of_reserved_cpus():
    assert WorkerResources(num_cpus=1.5, num_gpus=0).num_threads == 1
    assert WorkerResources(num_cpus=0.25, num_gpus=0).num_threads == 1
    assert WorkerResources(num_cpus=4, num_gpus=0).num_threads == 4


def test_explicit_threads_override_reserved_cpus():
    assert WorkerResources(num_cpus=1, num_gpus=0, num_threads_override=2).num_threads == 2


def test_app_arg_is_validated():
    assert AppArgs.model_validate({"worker_num_threads": 2}).worker_num_threads == 2
    assert AppArgs.model_validate({}).worker_num_threads is None
    for bad in (0, -1, "many"):
        try:
            AppArgs.model_validate({"worker_num_threads": bad})
        except ValueError:
            continue
        raise AssertionError(f"worker_num_threads={bad!r} was accepted")
