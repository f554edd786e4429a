"""Engine (in-process asyncio loop) with FakeRunner: streams, n>1, abort, generate, errors."""

import asyncio
import contextlib
import dataclasses
import sys
import threading

import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.outputs import EngineRequest, FinishReason
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner, assert_pool_full, run_steps

CFG = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=128, max_num_batched_tokens=32)


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "async-scheduling"])
def _scheduling(request, monkeypatch):
    """Every test runs with both engine loops: step N+1 scheduled after N lands, or ahead of it."""
    monkeypatch.setattr(sys.modules[__name__], "CFG", dataclasses.replace(CFG, async_scheduling=request.param))

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def make_engine(delay_s=0.0, **kw):
    return Engine(CFG, FakeRunner(CFG.block_size, CFG.num_blocks, delay_s=delay_s), **kw)


def prompts(k):
    return [list(range(i * 10, i * 10 + 3 + 2 * i)) for i in range(k)]


def scheduler_reference(prompt_list, params):
    s = Scheduler(CFG)
    for i, p in enumerate(prompt_list):
        s.add_request(EngineRequest(f"x{i}", p, params))
    t = run_steps(s, FakeRunner(CFG.block_size, CFG.num_blocks))
    return [t.tokens[(f"x{i}", 0)] for i in range(len(prompt_list))]


async def collect(stream):
    return [d async for d in stream]


def test_streams_deliver_deltas_until_final():
    async def main():
        engine = make_engine()
        streams = [engine.add_request(EngineRequest(f"r{i}", p, GREEDY)) for i, p in enumerate(prompts(6))]
        results = await asyncio.gather(*(collect(s) for s in streams))
        return engine, results

    engine, results = asyncio.run(main())
    expected = scheduler_reference(prompts(6), GREEDY)
    for deltas, tokens in zip(results, expected):
        assert [t for d in deltas for t in d.new_token_ids] == tokens
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert_pool_full(engine.scheduler)
    assert engine.stats.num_generation_tokens == 6 * 12
    engine.close()


def test_n_sequences_multiplexed_on_one_stream():
    async def main():
        engine = make_engine()
        params = SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=5)
        return await collect(engine.add_request(EngineRequest("p", list(range(10)), params)))

    deltas = asyncio.run(main())
    assert {d.request_id for d in deltas} == {"p"}
    assert sorted(d.index for d in deltas if d.finished) == [0, 1, 2, 3]
    assert all(sum(len(d.new_token_ids) for d in deltas if d.index == i) == 5 for i in range(4))


def test_abort_mid_stream_frees_blocks_and_ends_stream():
    async def main():
        engine = make_engine(delay_s=0.002)
        stream = engine.add_request(EngineRequest("a", list(range(20)), SamplingParams(temperature=0.0, max_tokens=100)))
        other = engine.add_request(EngineRequest("b", list(range(5)), SamplingParams(temperature=0.0, max_tokens=30)))
        seen = []
        async for delta in stream:
            seen.append(delta)
            if len(seen) == 3:
                engine.abort("a")
        await collect(other)
        return engine, seen

    engine, seen = asyncio.run(main())
    assert seen[-1].finish_reason == FinishReason.ABORT and seen[-1].new_token_ids == []
    assert len(seen) <= 5  # 3 read + at most 1 already queued + the final (the step in flight is dropped)
    assert_pool_full(engine.scheduler)
    assert engine.stats.num_aborted_seqs == 1


def test_aclose_aborts_a_running_request():
    async def main():
        engine = make_engine(delay_s=0.001)
        stream = engine.add_request(EngineRequest("a", list(range(20)), SamplingParams(temperature=0.0, max_tokens=100)))
        async for _ in stream:
            break
        await stream.aclose()
        while engine._loop_task is not None and not engine._loop_task.done():
            await asyncio.sleep(0.005)
        return engine

    engine = asyncio.run(main())
    assert not engine.has_unfinished_requests()
    assert_pool_full(engine.scheduler)


def test_event_loop_stays_free_while_the_runner_works():
    ticks = []
    runner_threads = set()

    class Recording(FakeRunner):
        def execute(self, so):
            runner_threads.add(threading.current_thread())
            return super().execute(so)

    async def ticker(stop):
        while not stop.is_set():
            ticks.append(1)
            await asyncio.sleep(0.001)

    async def main():
        engine = Engine(CFG, Recording(CFG.block_size, CFG.num_blocks, delay_s=0.02))
        stop = asyncio.Event()
        task = asyncio.create_task(ticker(stop))
        await collect(engine.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))))
        stop.set()
        await task
        return engine

    engine = asyncio.run(main())
    assert len(ticks) >= 10  # 3 steps x 20 ms of runner time, the loop kept ticking
    assert len(runner_threads) == 1 and threading.main_thread() not in runner_threads  # one worker thread


def test_generate_sync_helper_and_prefix_cache():
    engine = make_engine()
    shared = list(range(100, 130))
    results = engine.generate([shared + [1], shared + [2]], GREEDY)  # admitted together: no hit
    again = engine.generate([shared + [3]], GREEDY)[0]
    assert [r.num_cached_tokens for r in results] == [0, 0] and again.num_cached_tokens == 28
    assert [r.sequences[0].token_ids for r in results] == scheduler_reference([shared + [1], shared + [2]], GREEDY)
    assert results[0].sequences[0].finish_reason == FinishReason.LENGTH
    forked = engine.generate([list(range(9))], SamplingParams(temperature=0.0, n=3, max_tokens=4))[0]
    assert len({tuple(s.token_ids) for s in forked.sequences}) == 1 and len(forked.sequences) == 3
    engine.close()


def test_runner_error_fails_streams_and_engine_recovers():
    class Flaky(FakeRunner):
        fail = True

        def execute(self, so):
            if self.fail:
                self.fail = False
                raise RuntimeError("worker died")
            return super().execute(so)

    async def main():
        engine = Engine(CFG, Flaky(CFG.block_size, CFG.num_blocks))
        stream = engine.add_request(EngineRequest("a", [1, 2, 3], GREEDY))
        with pytest.raises(RuntimeError, match="worker died"):
            await collect(stream)
        assert_pool_full(engine.scheduler)
        deltas = await collect(engine.add_request(EngineRequest("b", [1, 2, 3], GREEDY)))
        return deltas

    assert sum(len(d.new_token_ids) for d in asyncio.run(main())) == 12


class FailsOnceWhen(FakeRunner):
    """Raises "kernel error" on the first step for which when(step number, step) holds."""

    def __init__(self, when):
        super().__init__(CFG.block_size, CFG.num_blocks)
        self.when = when
        self.failed = False
        self.forgets_may_repeat = True

    def execute(self, so):
        if not self.failed and self.when(self.num_steps + 1, so):
            self.failed = True
            self.num_steps += 1
            raise RuntimeError("kernel error")
        return super().execute(so)


@pytest.mark.parametrize("fail_at_step", [1, 3])
def test_a_live_worker_forgets_the_requests_of_a_failed_step(fail_at_step):
    """A runner error on a worker that stays up fails its requests; the worker must not keep
    their state (it would grow with every error). At step 1 the worker never registered "a"
    (its forget names an id it does not know); at step 3 it did."""

    async def main():
        runner = FailsOnceWhen(lambda step, so: step == fail_at_step)
        engine = Engine(CFG, runner)
        with pytest.raises(RuntimeError, match="kernel error"):
            await collect(engine.add_request(EngineRequest("a", list(range(40)), GREEDY)))
        deltas = await collect(engine.add_request(EngineRequest("b", [1, 2, 3], GREEDY)))
        assert_pool_full(engine.scheduler)
        return runner, deltas

    runner, deltas = asyncio.run(main())
    assert sum(len(d.new_token_ids) for d in deltas) == 12
    assert ("a" in runner.registered) == (fail_at_step > 1)
    assert "a" not in runner.requests  # ("b" is forgotten with the step after it, which never comes)


def test_a_failed_step_also_forgets_the_requests_it_was_to_tell_the_worker_to_forget():
    """A request that ended before the failing step rides in that step's finished ids; the
    step never reached the worker, so the step after the error must name it again."""

    async def main():
        runner = FailsOnceWhen(lambda step, so: "x" in so.finished_request_ids)
        engine = Engine(CFG, runner)
        x = engine.add_request(EngineRequest("x", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=1)))
        a = engine.add_request(EngineRequest("a", list(range(8)), GREEDY))
        assert len(await collect(x)) == 1
        with pytest.raises(RuntimeError, match="kernel error"):
            await collect(a)
        await collect(engine.add_request(EngineRequest("c", [1, 2, 3], GREEDY)))  # its step carries the forgets
        return runner

    runner = asyncio.run(main())
    assert runner.failed and {"x", "a"} <= runner.registered
    assert not {"x", "a"} & set(runner.requests), sorted(runner.requests)


def test_a_failed_step_also_forgets_requests_retired_during_it():
    """A request aborted while the failing step runs (a stop string, a client gone) is already
    retired when the error lands; the worker must be told to forget it too."""
    import threading

    class AbortsThenFails(FakeRunner):
        engine = loop = None

        def execute(self, so):
            if self.num_steps == 4:
                self.num_steps += 1
                aborted = threading.Event()

                def abort_b():
                    self.engine.abort("b")
                    aborted.set()

                self.loop.call_soon_threadsafe(abort_b)
                assert aborted.wait(10)
                raise RuntimeError("kernel error")
            return super().execute(so)

    async def drain(stream):
        with contextlib.suppress(RuntimeError):
            async for _ in stream:
                pass

    async def main():
        runner = AbortsThenFails(CFG.block_size, CFG.num_blocks)
        runner.forgets_may_repeat = True
        runner.loop = asyncio.get_running_loop()
        engine = runner.engine = Engine(CFG, runner)
        params = SamplingParams(temperature=0.0, max_tokens=12)
        await asyncio.gather(drain(engine.add_request(EngineRequest("a", list(range(8)), params))),
                             drain(engine.add_request(EngineRequest("b", list(range(9)), params))))
        await drain(engine.add_request(EngineRequest("c", [1, 2, 3], GREEDY)))  # its step carries the forgets
        return runner

    runner = asyncio.run(main())
    assert "b" in runner.registered and "a" in runner.registered
    assert not {"a", "b"} & set(runner.requests), sorted(runner.requests)


def test_async_runner_and_injected_clock():
    now = [100.0]

    class AsyncRunner:
        def __init__(self):
            self.inner = FakeRunner(CFG.block_size, CFG.num_blocks)

        async def execute(self, so):
            now[0] += 1.0
            await asyncio.sleep(0)
            return self.inner.execute(so)

    async def main():
        engine = Engine(CFG, AsyncRunner(), clock=lambda: now[0])
        stream = engine.add_request(EngineRequest("a", list(range(10)), SamplingParams(temperature=0.0, max_tokens=3)))
        await collect(stream)
        return stream

    stream = asyncio.run(main())
    # Ahead, the second step's execute() has begun (the clock ticked) before the first lands.
    first_token_time = 102.0 if CFG.async_scheduling else 101.0
    assert (stream.arrival_time, stream.first_token_time, stream.finish_time) == (100.0, first_token_time, 103.0)


def test_loop_stops_when_idle_and_restarts():
    async def main():
        engine = make_engine()
        await collect(engine.add_request(EngineRequest("a", [1, 2], GREEDY)))
        await asyncio.sleep(0.01)
        assert engine._loop_task.done()
        deltas = await collect(engine.add_request(EngineRequest("b", [1, 2], GREEDY)))
        return deltas

    assert sum(len(d.new_token_ids) for d in asyncio.run(main())) == 12


def test_duplicate_and_invalid_requests_raise():
    async def main():
        engine = make_engine()
        engine.add_request(EngineRequest("a", [1, 2], GREEDY))
        with pytest.raises(ValueError):
            engine.add_request(EngineRequest("a", [1, 2], GREEDY))
        with pytest.raises(ValueError):
            engine.add_request(EngineRequest("b", list(range(200)), GREEDY))
        engine.abort("a")
        return engine

    engine = asyncio.run(main())
    with pytest.raises(RuntimeError):  # outside an event loop: refused before any state changes
        engine.add_request(EngineRequest("c", [1, 2], GREEDY))
    assert not engine.has_unfinished_requests()


def test_runner_death_migrates_streams_to_another_engine():
    class DiesAfter(FakeRunner):
        def __init__(self, *a, steps, **kw):
            super().__init__(*a, **kw)
            self.steps_left = steps

        def execute(self, so):
            self.steps_left -= 1
            if self.steps_left < 0:
                raise RuntimeError("worker died")
            return super().execute(so)

    requests = [
        EngineRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=15)) for i, p in enumerate(prompts(5))
    ] + [EngineRequest("n3", list(range(30)), SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=15))]

    async def run(die_after):
        live = make_engine()
        moved = []

        def migrate(engine, error):
            moved.append(error)
            live.adopt(engine.take_for_migration())

        dying = Engine(CFG, DiesAfter(CFG.block_size, CFG.num_blocks, steps=die_after), on_runner_error=migrate)
        streams = [dying.add_request(q) for q in requests]
        results = await asyncio.gather(*(collect(s) for s in streams))
        return results, moved, live

    expected, moved, _ = asyncio.run(run(die_after=10_000))
    assert not moved
    for die_after in (0, 1, 3, 6):
        got, moved, live = asyncio.run(run(die_after))
        assert len(moved) == 1
        for deltas, want in zip(got, expected):
            for index in {d.index for d in want}:
                assert [t for d in deltas if d.index == index for t in d.new_token_ids] == [
                    t for d in want if d.index == index for t in d.new_token_ids
                ]
            assert sorted(d.index for d in deltas if d.finished) == sorted(d.index for d in want if d.finished)
        assert_pool_full(live.scheduler)


@pytest.mark.parametrize("method", ["schedule", "schedule_ahead", "update_from_output"])
def test_a_scheduler_error_fails_its_streams_and_the_engine_goes_on(method):
    """A bug in the scheduler (it raises mid-step) must not leave the engine stuck on its
    half-updated state, every later step failing: its requests end with the error and the
    next request runs."""
    if method == "schedule_ahead" and not CFG.async_scheduling:
        pytest.skip("only the async loop decides ahead")

    failing_call = 1 if method == "schedule" and CFG.async_scheduling else 3  # async: schedule() starts the run

    class Buggy(Scheduler):
        calls = 0

        def fail_once(self):
            Buggy.calls += 1
            if Buggy.calls == failing_call:
                raise KeyError("a scheduler bug")

    original = getattr(Scheduler, method)

    def buggy(self, *args):
        self.fail_once()
        return original(self, *args)

    setattr(Buggy, method, buggy)

    async def main():
        engine = Engine(CFG, FakeRunner(CFG.block_size, CFG.num_blocks), scheduler=Buggy(CFG))
        stream = engine.add_request(EngineRequest("a", [1, 2, 3], GREEDY))
        with pytest.raises(KeyError, match="a scheduler bug"):
            await collect(stream)
        deltas = await collect(engine.add_request(EngineRequest("b", [1, 2, 3], GREEDY)))
        assert_pool_full(engine.scheduler)
        return deltas

    deltas = asyncio.run(main())
    assert sum(len(d.new_token_ids) for d in deltas) == 12 and deltas[-1].finish_reason == FinishReason.LENGTH
