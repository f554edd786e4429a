"""The step channel: a scheduler's steps to a same-node worker over a Unix socket
(scheduler/step_channel.py, workers/step_server.py). No Ray, no torch."""

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from scheduler.outputs import CachedRequestData, ModelRunnerOutput, SchedulerOutput, WorkerStateLostError
from scheduler.step_channel import StepChannel, StepChannelClosed
from workers.step_server import StepServer

ROOT = Path(__file__).resolve().parents[2]


def step(*request_ids: str) -> SchedulerOutput:
    return SchedulerOutput([], [CachedRequestData(rid, [], 10) for rid in request_ids],
                           {rid: 1 for rid in request_ids}, len(request_ids))


class Recorder:
    """A runner stand-in: answers each step with a token per request, remembering the order."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.seen: list[list[str]] = []
        self.gate = gate

    def __call__(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.gate is not None:
            assert self.gate.wait(10)
        ids = list(scheduler_output.num_scheduled_tokens)
        if "lost" in ids:
            raise WorkerStateLostError("restarted")
        self.seen.append(ids)
        return ModelRunnerOutput({rid: len(self.seen) for rid in ids})


def test_pipelined_steps_run_and_answer_in_order() -> None:
    gate = threading.Event()
    recorder = Recorder(gate)
    server = StepServer(recorder)

    async def main() -> list[ModelRunnerOutput]:
        channel = await StepChannel.connect(server.path)
        futures = [channel.call(step(f"r{i}")) for i in range(5)]  # all sent before the first runs
        gate.set()
        results = await asyncio.gather(*futures)
        assert channel.num_calls == 5
        channel.close()
        return results

    results = asyncio.run(main())
    assert recorder.seen == [[f"r{i}"] for i in range(5)]
    assert [r.sampled_token_ids for r in results] == [{f"r{i}": i + 1} for i in range(5)]
    assert server.num_steps == 5
    server.close()


def test_a_runner_error_comes_back_as_itself_and_the_channel_goes_on() -> None:
    server = StepServer(Recorder())

    async def main() -> None:
        channel = await StepChannel.connect(server.path)
        with pytest.raises(WorkerStateLostError):
            await channel.call(step("lost"))
        assert (await channel.call(step("a"))).sampled_token_ids == {"a": 1}
        assert not channel.closed
        channel.close()

    asyncio.run(main())
    server.close()


def test_a_result_that_does_not_pickle_fails_only_its_step() -> None:
    def handle(scheduler_output: SchedulerOutput) -> object:
        if "odd" in scheduler_output.num_scheduled_tokens:
            return lambda: None  # no pickle for this
        return ModelRunnerOutput({"a": 1})

    server = StepServer(handle)

    async def main() -> None:
        channel = await StepChannel.connect(server.path)
        with pytest.raises(RuntimeError, match="unpicklable"):
            await channel.call(step("odd"))
        assert (await channel.call(step("a"))).sampled_token_ids == {"a": 1}  # replies still in step
        assert not channel.closed
        channel.close()

    asyncio.run(main())
    server.close()


def test_closing_the_channel_fails_its_pending_steps_at_once() -> None:
    gate = threading.Event()
    server = StepServer(Recorder(gate))

    async def main() -> None:
        channel = await StepChannel.connect(server.path)
        pending = channel.call(step("a"))
        channel.close()  # before its reader task has run at all
        with pytest.raises(StepChannelClosed):
            await asyncio.wait_for(pending, 5)

    try:
        asyncio.run(main())
    finally:
        gate.set()
        server.close()


WORKER = """
import sys, time
from scheduler.outputs import ModelRunnerOutput
from workers.step_server import StepServer
server = StepServer(lambda output: time.sleep(60) or ModelRunnerOutput({}))
print(server.path, flush=True)
time.sleep(120)
"""


def test_a_worker_killed_mid_step_fails_every_pending_step_as_closed() -> None:
    async def main() -> None:
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WORKER, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
        try:
            path = (await worker.stdout.readline()).decode().strip()
            channel = await StepChannel.connect(path)
            first, second = channel.call(step("a")), channel.call(step("b"))
            await asyncio.sleep(0.2)  # the worker is inside the first step
            worker.kill()
            for pending in (first, second):
                with pytest.raises(StepChannelClosed):
                    await asyncio.wait_for(pending, 10)
            assert channel.closed
            with pytest.raises(StepChannelClosed):  # later calls fail at once
                await channel.call(step("c"))
        finally:
            if worker.returncode is None:
                worker.kill()
            await worker.wait()

    asyncio.run(main())


def test_the_socket_is_private_to_this_user_and_removed_on_close() -> None:
    server = StepServer(Recorder())
    directory = os.path.dirname(server.path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(server.path).st_mode)
    server.close()
    assert not os.path.exists(directory)


def test_a_dead_processes_socket_directory_is_removed_by_the_next_server() -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # that process has exited
    stale = tempfile.mkdtemp(prefix=f"rayllm-steps-{dead_pid}-")
    alive = tempfile.mkdtemp(prefix=f"rayllm-steps-{os.getpid()}-")  # a live process's (ours)
    server = StepServer(Recorder())
    try:
        assert not os.path.exists(stale)
        assert os.path.isdir(alive)
        assert os.path.basename(os.path.dirname(server.path)).startswith(f"rayllm-steps-{os.getpid()}-")
    finally:
        server.close()
        shutil.rmtree(alive, ignore_errors=True)
