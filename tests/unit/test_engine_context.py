"""The engine's step loop must not run in the context of the request that started it.

Ray parents every call made in a request's context (the `async_task_id` contextvar) to that
request's actor task, and cancels those calls when the request's task is cancelled (a client
that went away): a step loop inheriting one request's context had its worker step cancelled,
failing every other request in the batch with TaskCancelledError.
"""

import asyncio
import contextvars

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.testing import FakeRunner

CFG = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=128, max_num_batched_tokens=32)
caller = contextvars.ContextVar("caller", default=None)


class ContextRecordingRunner(FakeRunner):
    def __init__(self) -> None:
        super().__init__(CFG.block_size, CFG.num_blocks)
        self.seen: set[object] = set()

    async def execute(self, scheduler_output):  # async: runs on the loop task itself
        self.seen.add(caller.get())
        return super().execute(scheduler_output)


def test_the_step_loop_does_not_inherit_the_first_requests_context() -> None:
    runner = ContextRecordingRunner()
    engine = Engine(CFG, runner)

    async def request(name: str) -> None:
        caller.set(name)
        stream = engine.add_request(EngineRequest(name, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True)))
        async for _ in stream:
            pass

    async def main() -> None:
        await asyncio.gather(asyncio.create_task(request("a")), asyncio.create_task(request("b")))

    asyncio.run(main())
    assert runner.seen == {None}
