"""Elastic workers in EngineGroup (scheduler/engine_group.py, pure): a starting worker takes no
requests until it serves, a retiring one drains and then hands what is left to the others (the
streams go on with the same tokens), and a request can wait for a worker to start."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.engine_group import DRAINING, RETIRED, SERVING, STARTING, EngineGroup, NoLiveWorkerError, TimedRunner
from scheduler.outputs import EngineRequest
from scheduler.router import Router, RouterConfig
from scheduler.sampling_params import SamplingParams
from scheduler.testing import FakeRunner

CFG = SchedulerConfig(block_size=4, num_blocks=128, max_model_len=256, max_num_batched_tokens=64)


def worker(delay_s: float = 0.0) -> tuple[Engine, TimedRunner]:
    runner = TimedRunner(FakeRunner(CFG.block_size, CFG.num_blocks, delay_s=delay_s))
    return Engine(CFG, runner), runner


def group_of(num_workers: int, delay_s: float = 0.0) -> EngineGroup:
    pairs = [worker(delay_s) for _ in range(num_workers)]
    return EngineGroup([e for e, _ in pairs], [r for _, r in pairs], router=Router(RouterConfig(policy="least_loaded")))


def request(i: int, max_tokens: int = 24) -> EngineRequest:
    return EngineRequest(f"r{i}", [7 + i, 3, 5, 11 + i, 2, 9], SamplingParams(temperature=0.0, max_tokens=max_tokens))


async def tokens_of(stream) -> list[int]:
    return [t for output in [o async for o in stream] for t in output.new_token_ids]


async def baseline(num_requests: int) -> list[list[int]]:
    group = group_of(1)
    return list(await asyncio.gather(*(tokens_of(group.add_request(request(i))) for i in range(num_requests))))


def test_a_starting_worker_takes_nothing_until_it_serves() -> None:
    async def main():
        group = group_of(1)
        index = group.add_worker(*worker())
        assert group.states == [SERVING, STARTING] and group.serving() == {0}
        owners = [group.owner_of(r.request_id) for r in (request(0), request(1)) if group.add_request(r)]
        group.mark_serving(index)
        group.add_request(request(2))
        status = group.status()
        return owners, group.owner_of("r2"), status

    owners, third, status = asyncio.run(main())
    assert owners == [0, 0] and third == 1  # least loaded: the new, empty worker
    assert (status.num_workers, status.num_live_workers, status.num_starting_workers) == (2, 2, 0)


@pytest.mark.parametrize("drain_timeout_s", [0.0, 30.0])
def test_retiring_mid_stream_loses_nothing_and_changes_no_token(drain_timeout_s) -> None:
    """drain 0: every open request moves to the other worker at once; drain 30: they finish where they are."""
    async def main():
        expected = await baseline(6)
        group = group_of(2, delay_s=0.002)
        streams = [group.add_request(request(i)) for i in range(6)]
        on_first = [i for i in range(6) if group.owner_of(f"r{i}") == 0]
        collected = asyncio.gather(*(tokens_of(stream) for stream in streams))
        await asyncio.sleep(0.02)  # mid-stream
        assert group.engines[0].has_unfinished_requests()
        moved = await group.retire(0, drain_timeout_s)
        got = await collected
        return expected, got, moved, on_first, group

    expected, got, moved, on_first, group = asyncio.run(main())
    assert got == expected
    assert moved == (len(on_first) if drain_timeout_s == 0.0 else 0) and on_first
    assert group.states == [RETIRED, SERVING] and group.serving() == {1}
    assert group.status().num_migrated_requests == moved and group.status().num_workers == 1
    with pytest.raises(AssertionError):
        asyncio.run(group.retire(0, 0.0))  # retired once


def test_a_draining_worker_takes_no_new_requests() -> None:
    async def main():
        group = group_of(2, delay_s=0.002)
        long = group.add_request(request(0, max_tokens=40))
        first = group.owner_of("r0")
        retiring = asyncio.create_task(group.retire(first, 30.0))
        await asyncio.sleep(0)
        assert group.states[first] == DRAINING
        later = [group.add_request(request(i)) for i in range(1, 4)]
        owners = {group.owner_of(f"r{i}") for i in range(1, 4)}
        await asyncio.gather(tokens_of(long), *(tokens_of(s) for s in later), retiring)
        return first, owners

    first, owners = asyncio.run(main())
    assert owners == {1 - first}


def test_a_request_waits_for_a_worker_to_start_after_scale_to_zero() -> None:
    async def main():
        group = group_of(1)
        await group.retire(0, 0.0)
        with pytest.raises(NoLiveWorkerError):
            group.add_request(request(0))
        assert not await group.wait_for_serving(0.05)
        waiting = asyncio.create_task(group.wait_for_serving(10.0))
        await asyncio.sleep(0.05)
        index = group.add_worker(*worker())
        assert not waiting.done()
        group.mark_serving(index)
        assert await waiting
        return await tokens_of(group.add_request(request(0))), await baseline(1)

    got, (expected,) = asyncio.run(main())
    assert got == expected


def test_unique_cached_blocks_count_what_only_that_worker_holds() -> None:
    async def main():
        group = group_of(2)
        shared = EngineRequest("a", list(range(40)), SamplingParams(temperature=0.0, max_tokens=1))
        await tokens_of(group.engines[0].add_request(shared))
        await tokens_of(group.engines[1].add_request(EngineRequest("b", list(range(40)), shared.sampling_params)))
        own = EngineRequest("c", list(range(100, 140)), shared.sampling_params)
        await tokens_of(group.engines[0].add_request(own))
        return group.unique_cached_blocks()

    unique = asyncio.run(main())
    assert unique[1] == 0 and unique[0] == 40 // CFG.block_size
