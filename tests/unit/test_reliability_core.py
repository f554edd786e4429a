"""Reliability in the pure core: admission (bounded queue, drain), a dead worker's requests
migrating to a live one with identical streams, parking while no worker lives, and requests
resumed with their streamed tokens (what the ingress sends after a scheduler restart)."""

from __future__ import annotations

import dataclasses

import asyncio

import pytest

from scheduler.admission import Admission, AdmissionConfig, DrainingError, QueueFullError
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.engine_group import EngineGroup, TimedRunner
from scheduler.outputs import EngineRequest, FinishReason, WorkerStateLostError
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler, SchedulerLoad
from scheduler.testing import FakeRunner, assert_pool_full, run_steps

CFG = SchedulerConfig(block_size=4, num_blocks=96, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8)


class WorkerDied(Exception):
    pass


class DyingRunner:
    """A FakeRunner that dies (raises WorkerDied) on its `die_at`-th step, once."""

    def __init__(self, die_at: int | None, recurrent: bool = False) -> None:
        self.recurrent = recurrent  # a model with recurrent layers: the fake checks each request's state
        self.inner = FakeRunner(CFG.block_size, CFG.num_blocks, recurrent=recurrent)
        self.die_at = die_at
        self.num_calls = 0

    def execute(self, scheduler_output):
        self.num_calls += 1
        if self.num_calls == self.die_at:
            self.inner = FakeRunner(CFG.block_size, CFG.num_blocks, recurrent=self.recurrent)  # a restart: empty
            raise WorkerDied("killed")
        return self.inner.execute(scheduler_output)


def make_group(die_at: list[int | None], admission: Admission | None = None, recurrent: bool = False) -> EngineGroup:
    runners = [TimedRunner(DyingRunner(d, recurrent),
                           is_death=lambda e: isinstance(e, (WorkerDied, WorkerStateLostError))) for d in die_at]
    config = dataclasses.replace(CFG, recurrent_state=True, num_state_snapshots=4) if recurrent else CFG
    engines = [Engine(config, runner) for runner in runners]
    return EngineGroup(engines, runners, admission=admission)


def requests() -> list[EngineRequest]:
    out = [EngineRequest(f"g{i}", list(range(i * 11, i * 11 + 7 + i)), SamplingParams(temperature=0.0, max_tokens=20))
           for i in range(8)]
    out.append(EngineRequest("seeded", list(range(300, 321)), SamplingParams(temperature=1.0, seed=7, max_tokens=18)))
    out.append(EngineRequest("fork", list(range(400, 409)), SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=14)))
    return out


async def collect(stream) -> dict[int, tuple[list[int], FinishReason]]:
    seqs: dict[int, list[int]] = {}
    reasons: dict[int, FinishReason] = {}
    async for delta in stream:
        assert delta.index not in reasons, "a delta after the final one"
        seqs.setdefault(delta.index, []).extend(delta.new_token_ids)
        if delta.finished:
            reasons[delta.index] = delta.finish_reason
    return {i: (seqs.get(i, []), reasons[i]) for i in reasons}


async def run_group(group: EngineGroup) -> dict[str, dict]:
    streams = {q.request_id: group.add_request(q) for q in requests()}
    results = await asyncio.gather(*(collect(s) for s in streams.values()))
    for rid in streams:
        group.forget(rid)
    return dict(zip(streams, results))


# --- admission -----------------------------------------------------------------------------
def load(running: int, waiting: int, waiting_tokens: int = 0) -> SchedulerLoad:
    return SchedulerLoad(running, waiting, waiting_tokens, 10, 10)


def test_admission_counts_only_what_exceeds_the_running_seats() -> None:
    admission = Admission(AdmissionConfig(max_queued_requests=3, max_queued_tokens=100, max_num_seqs=4))
    admission.check([load(0, 5), load(4, 1)], 10)  # 1 + 1 queued < 3
    with pytest.raises(QueueFullError) as full:
        admission.check([load(4, 3), load(0, 0)], 10)
    assert full.value.retry_after_s == 1 and admission.num_rejected["queue_requests"] == 1
    with pytest.raises(QueueFullError):
        admission.check([load(0, 1, waiting_tokens=95)], 10)  # tokens
    admission.check([load(0, 0)], 10_000)  # nothing waits: a lone huge prompt is let in
    admission.draining = True
    with pytest.raises(DrainingError):
        admission.check([load(0, 0)], 1)
    assert admission.num_rejected_total == 3


def test_queue_overflow_refuses_then_every_accepted_request_completes() -> None:
    async def main():
        admission = Admission(AdmissionConfig(max_queued_requests=3, max_num_seqs=CFG.max_num_seqs))
        group = make_group([None, None], admission)
        accepted, refused = [], 0
        for i in range(40):
            q = EngineRequest(f"q{i}", list(range(i, i + 5)), SamplingParams(temperature=0.0, max_tokens=6))
            try:
                accepted.append(group.add_request(q))
            except QueueFullError:
                refused += 1
        assert len(accepted) == 2 * CFG.max_num_seqs + 3 and refused == 40 - len(accepted)
        results = await asyncio.gather(*(collect(s) for s in accepted))
        assert all(r[0][1] == FinishReason.LENGTH and len(r[0][0]) == 6 for r in results)
        assert group.status().num_rejected_requests == refused
    asyncio.run(main())


# --- worker death ------------------------------------------------------------------------------
@pytest.mark.parametrize("recurrent", [False, True], ids=["kv", "recurrent-states"])
@pytest.mark.parametrize("die_at", [1, 2, 5, 9])
def test_a_dead_workers_requests_finish_on_the_live_one_with_identical_streams(die_at: int, recurrent: bool) -> None:
    """Also for a model with recurrent layers: the requests moved start their states again on the live
    worker (from zero, or from its own snapshots), as the fake worker checks step by step."""
    expected = asyncio.run(run_group(make_group([None, None], recurrent=recurrent)))

    async def main():
        group = make_group([die_at, None], recurrent=recurrent)
        got = await run_group(group)
        status = group.status()
        assert status.num_migrated_requests > 0 and status.num_live_workers == 1
        assert_pool_full(group.engines[0].scheduler)  # its block accounting was dropped
        for engine in group.engines:
            assert not engine.has_unfinished_requests()
        return got

    assert asyncio.run(main()) == expected


def test_with_no_live_worker_requests_wait_for_a_restart_and_aborts_still_work() -> None:
    expected = asyncio.run(run_group(make_group([None])))

    async def main():
        group = make_group([3])
        streams = {q.request_id: group.add_request(q) for q in requests()}
        tasks = {rid: asyncio.create_task(collect(s)) for rid, s in streams.items()}
        while not group._parked:
            await asyncio.sleep(0.001)
        group.abort("g1")  # aborted while parked: final abort delta, never runs again
        assert group.status().num_unfinished_requests == len(streams)
        group.runners[0].alive = True  # Ray restarted the worker; the actor's ping saw it
        results = {rid: await task for rid, task in tasks.items()}
        assert results.pop("g1")[0][1] == FinishReason.ABORT
        return results

    got = asyncio.run(main())
    expected.pop("g1")
    assert got == expected


def test_a_failing_but_live_worker_fails_its_streams() -> None:
    class Broken(FakeRunner):
        def execute(self, scheduler_output):
            raise RuntimeError("kernel bug")

    async def main():
        runner = TimedRunner(Broken(CFG.block_size, CFG.num_blocks), is_death=lambda e: False)
        group = EngineGroup([Engine(CFG, runner)], [runner])
        stream = group.add_request(requests()[0])
        with pytest.raises(RuntimeError, match="kernel bug"):
            await collect(stream)
        assert_pool_full(group.engines[0].scheduler)
    asyncio.run(main())


def test_a_live_worker_that_fails_once_forgets_those_requests_and_goes_on() -> None:
    class FailsOnce(FakeRunner):
        def execute(self, scheduler_output):
            if self.num_steps == 2:
                self.num_steps += 1
                raise RuntimeError("kernel bug")
            return super().execute(scheduler_output)

    async def main():
        worker = FailsOnce(CFG.block_size, CFG.num_blocks)
        runner = TimedRunner(worker, is_death=lambda e: False)
        group = EngineGroup([Engine(CFG, runner)], [runner])
        with pytest.raises(RuntimeError, match="kernel bug"):
            await collect(group.add_request(requests()[0]))
        group.forget(requests()[0].request_id)
        after = await collect(group.add_request(requests()[1]))
        assert_pool_full(group.engines[0].scheduler)
        return worker, after

    worker, after = asyncio.run(main())
    assert after[0][1] == FinishReason.LENGTH and len(after[0][0]) == 20
    assert requests()[0].request_id in worker.registered
    assert requests()[0].request_id not in worker.requests


# --- drain ---------------------------------------------------------------------------------------
def test_drain_refuses_new_requests_and_lets_open_ones_finish() -> None:
    async def main():
        group = make_group([None, None])
        streams = [group.add_request(q) for q in requests()[:4]]
        readers = [asyncio.create_task(collect(s)) for s in streams]

        async def forget_when_done():  # what the actor's generate() does when a stream ends
            for q, reader in zip(requests()[:4], readers):
                await reader
                group.forget(q.request_id)

        forgetting = asyncio.create_task(forget_when_done())
        drained = asyncio.create_task(group.drain(timeout_s=30))
        await asyncio.sleep(0)
        with pytest.raises(DrainingError):
            group.add_request(requests()[5])
        assert group.status().draining
        assert await drained == 0
        await forgetting
        assert all(r[0][1] == FinishReason.LENGTH for r in [reader.result() for reader in readers])
    asyncio.run(main())


def test_drain_aborts_what_is_left_at_the_deadline() -> None:
    async def main():
        group = make_group([None])
        stream = group.add_request(EngineRequest("long", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=100)))
        reader = asyncio.create_task(collect(stream))
        assert await group.drain(timeout_s=0.0) == 1
        assert (await reader)[0][1] == FinishReason.ABORT
    asyncio.run(main())


# --- resumed requests (after a scheduler restart) ------------------------------------------------------
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=1.0, seed=11, max_tokens=12, presence_penalty=0.5),
])
@pytest.mark.parametrize("cut", [0, 1, 5, 11])
def test_a_request_resumed_with_its_streamed_tokens_continues_the_same_stream(params, cut) -> None:
    prompt = list(range(50, 63))
    full = Scheduler(CFG)
    full.add_request(EngineRequest("a", prompt, params))
    tokens = run_steps(full, FakeRunner(CFG.block_size, CFG.num_blocks)).tokens[("a", 0)]
    assert len(tokens) == 12
    resumed = Scheduler(CFG)
    resumed.add_request(EngineRequest("a@1", prompt, params, output_token_ids=tuple(tokens[:cut])))
    t = run_steps(resumed, FakeRunner(CFG.block_size, CFG.num_blocks))
    assert tokens[:cut] + t.tokens[("a@1", 0)] == tokens
    assert t.finish_reasons[("a@1", 0)] == FinishReason.LENGTH
    assert_pool_full(resumed)


def test_resumed_requests_are_validated() -> None:
    s = Scheduler(CFG)
    with pytest.raises(ValueError, match="n=1"):
        s.add_request(EngineRequest("x", [1, 2], SamplingParams(n=2, max_tokens=4), output_token_ids=(3,)))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(EngineRequest("y", [1, 2], SamplingParams(max_tokens=2), output_token_ids=(3, 4)))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(EngineRequest("z", [1] * 100, SamplingParams(max_tokens=100), output_token_ids=(3,) * 30))
