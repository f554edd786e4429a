"""WorkerActor's repr (the Ray dashboard's actor list) and set_state, on the plain class under
Ray's decorator, with a stand-in runner: no Ray cluster, no model."""

from __future__ import annotations

import threading
import time

import pytest

import workers.model_runner as model_runner
import workers.step_server as step_server
from workers.actor import WorkerActor, describe_worker
from workers.model_runner import ModelInfo

Actor = WorkerActor.__ray_actor_class__  # the class Ray wraps; its methods are plain functions


class SlowRunner:
    """Loads until `release` is set; then reports a resolved device and dtype."""

    release = threading.Event()

    def __init__(self, config: dict) -> None:
        assert SlowRunner.release.wait(30)
        self.model_info = ModelInfo(model_path="/cache/rayllm/SmolLM2-135M-Instruct", eos_token_ids=(2,),
                                    max_model_len=64, vocab_size=100, num_blocks=8, block_size=16,
                                    device="cpu", dtype="bfloat16")


class NoStepServer:
    def __init__(self, execute) -> None:
        raise OSError("no socket in this test")


@pytest.fixture
def stand_ins(monkeypatch) -> None:
    monkeypatch.setattr(model_runner, "ModelRunner", SlowRunner)
    monkeypatch.setattr(model_runner, "RunnerConfig", lambda **kwargs: kwargs)
    monkeypatch.setattr(step_server, "StepServer", NoStepServer)
    SlowRunner.release.clear()


def test_repr_names_model_device_dtype_and_goes_from_starting_to_serving_to_draining(stand_ins) -> None:
    actor = Actor.__new__(Actor)
    loading = threading.Thread(target=actor.__init__, args=({"model": "/models/my-llama/", "device": "cpu",
                                                             "dtype": "auto"},))
    loading.start()
    try:
        deadline = time.monotonic() + 30
        while "my-llama" not in repr(actor) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert repr(actor) == "WorkerActor(model=my-llama, device=cpu, dtype=auto, state=starting)"
    finally:
        SlowRunner.release.set()
        loading.join(30)
    # loaded: the runner's resolved model path and dtype
    assert repr(actor) == "WorkerActor(model=SmolLM2-135M-Instruct, device=cpu, dtype=bfloat16, state=serving)"
    actor.set_state("draining")
    assert repr(actor).endswith("state=draining)")
    with pytest.raises(ValueError, match="starting, serving, draining"):
        actor.set_state("gone")
    assert repr(actor).endswith("state=draining)")


def test_repr_never_raises_before_init_or_on_odd_values() -> None:
    bare = Actor.__new__(Actor)  # what a log line could see before __init__ ran
    assert repr(bare) == "WorkerActor(model=default, device=?, dtype=?, state=starting)"

    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no")

    bare._identity = (Unprintable(), "cpu", "float32")
    assert repr(bare) == "WorkerActor(?)"
    bare._identity = None  # not a tuple at all
    assert repr(bare) == "WorkerActor(?)"


def test_the_default_model_shows_as_default() -> None:
    assert describe_worker(None, "cuda", "float16", "serving") == (
        "WorkerActor(model=default, device=cuda, dtype=float16, state=serving)")
    assert describe_worker("default", "cpu", "auto", "starting").startswith("WorkerActor(model=default,")
