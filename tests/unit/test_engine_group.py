"""EngineGroup and TimedRunner (scheduler/engine_group.py, pure): routing through
the Router, concurrent per-worker engine loops, aborts and status, with FakeRunners."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest

from scheduler.engine_group import EngineGroup, NoLiveWorkerError, TimedRunner
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.outputs import EngineRequest, FinishReason
from scheduler.router import RouteOutcome, Router, RouterConfig
from scheduler.sampling_params import SamplingParams
from scheduler.testing import FakeRunner

CFG = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=128, max_num_batched_tokens=32)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async-scheduling"])
def _scheduling(request, monkeypatch):
    """Every test runs with both engine loops: step N+1 scheduled after N lands, or ahead of it."""
    monkeypatch.setattr(sys.modules[__name__], "CFG", dataclasses.replace(CFG, async_scheduling=request.param))


PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_group(
    num_workers: int = 2,
    delay_s: float | list[float] = 0.0,
    clock: Clock | None = None,
    router: RouterConfig | None = None,
) -> EngineGroup:
    clock = clock or Clock()
    delays = delay_s if isinstance(delay_s, list) else [delay_s] * num_workers
    runners = [TimedRunner(FakeRunner(CFG.block_size, CFG.num_blocks, delay_s=d), clock) for d in delays]
    engines = [Engine(CFG, runner) for runner in runners]
    return EngineGroup(engines, runners, clock, Router(router))


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


def shared_prefix_request(rid: str, family: int, question: int) -> EngineRequest:
    system = [1000 + 100 * family + k for k in range(12)]  # 3 full blocks of 4
    return EngineRequest(rid, system + [question, question + 1], PARAMS)


def test_prefix_aware_routing_keeps_each_family_on_one_worker_and_counts_outcomes() -> None:
    async def main():
        group = make_group()
        owners = {}
        for question in range(4):  # a wave of one question per family, interleaved
            streams = []
            for family in range(2):
                rid = f"f{family}q{question}"
                streams.append(group.add_request(shared_prefix_request(rid, family, question)))
                owners[rid] = group.owner_of(rid)
            await asyncio.gather(*(drain(stream) for stream in streams))
            for family in range(2):
                group.forget(f"f{family}q{question}")
        return group, owners

    group, owners = asyncio.run(main())
    for family in range(2):
        assert len({owners[f"f{family}q{q}"] for q in range(4)}) == 1, owners
    assert owners["f0q0"] != owners["f1q0"]  # a new prefix goes to the worker with the most free cache
    assert group.route_counts == {RouteOutcome.NO_MATCH_MOST_FREE.value: 2, RouteOutcome.PREFIX_HIT.value: 6}
    hits = sum(engine.stats.num_prefix_hit_tokens for engine in group.engines)
    assert hits == 6 * 12  # every later request of a family hit its 3 system blocks
    stats = group.routing_stats()
    assert stats["policy"] == "prefix_aware" and stats["routed_per_worker"] == [4, 4]
    assert sum(stats["prefix_hit_tokens_per_worker"]) == hits and all(stats["steps_per_worker"])
    assert stats["running_per_worker"] == [0, 0]  # every request has finished


def test_the_policy_comes_from_the_router_config() -> None:
    async def main():
        group = make_group(num_workers=3, router=RouterConfig(policy="round_robin"))
        owners = []
        for i in range(6):
            stream = group.add_request(shared_prefix_request(f"r{i}", 0, i))
            owners.append(group.owner_of(f"r{i}"))
            await drain(stream)
            group.forget(f"r{i}")
        return group, owners

    group, owners = asyncio.run(main())
    assert owners == [0, 1, 2, 0, 1, 2]
    assert group.route_counts == {RouteOutcome.ROUND_ROBIN.value: 6}


def test_no_live_worker_is_a_clear_error_and_dead_workers_are_never_chosen() -> None:
    async def main():
        group = make_group(num_workers=3)
        group.runners[0].alive = False
        streams = [group.add_request(request(i)) for i in range(4)]  # a burst spreads over the live ones
        owners = [group.owner_of(f"r{i}") for i in range(4)]
        await asyncio.gather(*(drain(stream) for stream in streams))
        for i in range(4):
            group.forget(f"r{i}")
        for runner in group.runners:
            runner.alive = False
        with pytest.raises(NoLiveWorkerError):
            group.add_request(request(9))
        return group, owners

    group, owners = asyncio.run(main())
    assert 0 not in owners and set(owners) == {1, 2}
    assert group.owner_of("r9") is None and group.status().num_unfinished_requests == 0


def test_n_greater_than_one_children_stay_on_the_parent_worker() -> None:
    async def main():
        group = make_group()
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=4)
        stream = group.add_request(EngineRequest("multi", list(range(10)), params))
        owner = group.owner_of("multi")
        await stream.__anext__()
        running = [engine.scheduler.num_running_seqs for engine in group.engines]
        outputs = await drain(stream)
        group.forget("multi")
        return owner, running, outputs

    owner, running, outputs = asyncio.run(main())
    assert running[owner] == 4 and running[1 - owner] == 0
    assert sorted({o.index for o in outputs}) == [0, 1, 2, 3]


def test_a_slow_worker_never_stalls_the_other_workers_steps() -> None:
    """Worker 0 takes 0.3 s a step; worker 1's request (9 steps) finishes during worker 0's
    first step or two, because each engine runs its own loop and a blocking worker runs on its
    runner's own thread."""
    slow_s = 0.3

    async def main():
        group = make_group(delay_s=[slow_s, 0.0])
        slow = group.add_request(request(1))
        fast = group.add_request(request(2))
        assert (group.owner_of("r1"), group.owner_of("r2")) == (0, 1)
        fast_outputs = await drain(fast)
        slow_steps_meanwhile = group.runners[0].num_steps
        slow_outputs = await drain(slow)
        return slow_steps_meanwhile, fast_outputs, slow_outputs, group

    slow_steps, fast_outputs, slow_outputs, group = asyncio.run(main())
    assert sum(len(o.new_token_ids) for o in fast_outputs) == 8
    assert sum(len(o.new_token_ids) for o in slow_outputs) == 8
    assert group.runners[1].num_steps >= 8
    assert slow_steps <= 1, slow_steps  # worker 1's 9 steps ran while worker 0 took at most one
    group.close()
