"""EngineGroup, TimedRunner and batched() from scheduler/actor.py, without a Ray cluster
(the module imports ray, so these live outside tests/unit)."""

from __future__ import annotations

import asyncio

from scheduler.actor import EngineGroup, TimedRunner, batched
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.outputs import EngineRequest, FinishReason
from scheduler.sampling_params import SamplingParams
from scheduler.testing import FakeRunner

CFG = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=128, max_num_batched_tokens=32)
PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_group(num_workers: int = 2, delay_s: float = 0.0, clock: Clock | None = None) -> EngineGroup:
    clock = clock or Clock()
    runners = [TimedRunner(FakeRunner(CFG.block_size, CFG.num_blocks, delay_s=delay_s), clock) for _ in range(num_workers)]
    engines = [Engine(CFG, runner) for runner in runners]
    return EngineGroup(engines, runners, clock)


def request(i: int, max_tokens: int = 8) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return EngineRequest(f"r{i}", list(range(i, i + 6)), params)


async def drain(stream) -> list:
    return [output async for output in stream]


def test_requests_spread_over_workers_and_finish() -> None:
    async def main():
        group = make_group()
        streams = [group.add_request(request(i)) for i in range(4)]
        owners = [group._owner[f"r{i}"] for i in range(4)]
        results = await asyncio.gather(*(drain(s) for s in streams))
        for i in range(4):
            group.forget(f"r{i}")
        return group, owners, results

    group, owners, results = asyncio.run(main())
    assert sorted(owners) == [0, 0, 1, 1]
    assert all(sum(len(o.new_token_ids) for o in outputs) == 8 for outputs in results)
    status = group.status()
    assert (status.num_running, status.num_unfinished_requests, status.seconds_since_last_step) == (0, 0, None)
    assert status.num_kv_blocks_free == status.num_kv_blocks_total == 2 * (CFG.num_blocks - 1)
    assert status.num_steps > 0 and status.num_live_workers == 2


def test_abort_frees_blocks_and_an_early_abort_refuses_the_request() -> None:
    async def main():
        group = make_group(delay_s=0.002)
        stream = group.add_request(request(1, max_tokens=100))
        first = await stream.__anext__()
        group.abort("r1")
        rest = await drain(stream)
        group.forget("r1")
        group.abort("r2")  # before r2 arrives
        refused = group.add_request(request(2))
        return group, first, rest, refused

    group, first, rest, refused = asyncio.run(main())
    assert rest[-1].finish_reason == FinishReason.ABORT
    assert refused is None
    status = group.status()
    assert status.num_running == 0 and status.num_kv_blocks_free == status.num_kv_blocks_total


def test_dead_workers_are_skipped_and_stalls_are_reported() -> None:
    clock = Clock()
    group = make_group(clock=clock)
    group.runners[0].alive = False

    async def main():
        stream = group.add_request(request(7))
        assert group._owner["r7"] == 1
        clock.now = 50.0  # the engine has pending work and has not stepped yet
        stalled = group.status()
        await drain(stream)
        group.forget("r7")
        return stalled

    stalled = asyncio.run(main())
    assert stalled.num_live_workers == 1
    assert stalled.seconds_since_last_step == 50.0


def test_batched_yields_everything_once_in_order() -> None:
    async def source():
        for i in range(10):
            yield i
            if i % 3 == 0:
                await asyncio.sleep(0)

    async def main():
        batches = []
        async for batch in batched(source()):
            batches.append(batch)
            await asyncio.sleep(0.001)  # a slow reader gets bigger batches
        return batches

    batches = asyncio.run(main())
    assert [item for batch in batches for item in batch] == list(range(10))
    assert len(batches) < 10
