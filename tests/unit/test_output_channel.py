"""Output channels (scheduler/output_channel.py) over a real EngineGroup with FakeRunners:
one list per step per channel, nothing lost or duplicated, reader takeover, orphan reaping,
and the engine loop's overlap (a step's deltas are delivered while the next step runs)."""

from __future__ import annotations

import asyncio

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.engine_group import EngineGroup, TimedRunner
from scheduler.output_channel import OutputChannels, RequestFailed, failure_of
from scheduler.outputs import EngineRequest, FinishReason, RequestOutput
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner, assert_pool_full, run_steps

CFG = SchedulerConfig(block_size=4, num_blocks=128, max_model_len=128, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_group(num_workers: int = 1, delay_s: float = 0.0) -> EngineGroup:
    runners = [TimedRunner(FakeRunner(CFG.block_size, CFG.num_blocks, delay_s=delay_s)) for _ in range(num_workers)]
    return EngineGroup([Engine(CFG, runner) for runner in runners], runners)


def request(i: int, params: SamplingParams = GREEDY) -> EngineRequest:
    return EngineRequest(f"r{i}", list(range(10 * i, 10 * i + 5)), params)


def submit(group: EngineGroup, channels: OutputChannels, channel_id: str, req: EngineRequest) -> None:
    channel = channels.get(channel_id)
    assert group.add_request(req, channels.listener(channel, req.request_id)) is not None


async def read_until_done(channels: OutputChannels, channel_id: str, num_requests: int) -> list[list]:
    """Every batch of the channel until each request has its final delta."""
    batches, finals = [], 0
    async for batch in channels.read(channel_id):
        batches.append(batch)
        finals += sum(1 for item in batch if isinstance(item, RequestFailed) or item.finished)
        if finals == num_requests:
            return batches
    raise AssertionError("the channel's reader ended early")


def test_a_steps_deltas_of_every_request_arrive_as_one_batch() -> None:
    async def main():
        group = make_group()
        finished: list[str] = []
        channels = OutputChannels(abort=group.abort, on_finished=lambda rid: (finished.append(rid), group.forget(rid)))
        for i in range(8):
            submit(group, channels, "replica-a", request(i))
        batches = await read_until_done(channels, "replica-a", 8)
        return group, channels, batches, finished

    group, channels, batches, finished = asyncio.run(main())
    # all 8 are prefilled in one step and then decode together: one list per step, 8 deltas each
    assert [len(batch) for batch in batches] == [8] * GREEDY.max_tokens
    for i in range(8):
        mine = [item for batch in batches for item in batch if item.request_id == f"r{i}"]
        assert [len(item.new_token_ids) for item in mine] == [1] * GREEDY.max_tokens
        assert [item.finish_reason for item in mine][-1] is FinishReason.LENGTH
    assert sorted(finished) == sorted(f"r{i}" for i in range(8))
    assert channels.get("replica-a").open_request_ids == set() and group.status().num_unfinished_requests == 0
    assert channels.get("replica-a").num_batches == len(batches)
    assert_pool_full(group.engines[0].scheduler)


def test_channels_of_two_replicas_get_only_their_own_requests() -> None:
    async def main():
        group = make_group(num_workers=2)
        channels = OutputChannels(abort=group.abort, on_finished=group.forget)
        for i in range(6):
            submit(group, channels, "a" if i % 2 == 0 else "b", request(i))
        return await asyncio.gather(read_until_done(channels, "a", 3), read_until_done(channels, "b", 3))

    batches_a, batches_b = asyncio.run(main())
    ids_a = {item.request_id for batch in batches_a for item in batch}
    ids_b = {item.request_id for batch in batches_b for item in batch}
    assert ids_a == {"r0", "r2", "r4"} and ids_b == {"r1", "r3", "r5"}


def test_a_new_reader_takes_over_and_loses_nothing_buffered() -> None:
    async def main():
        group = make_group(delay_s=0.002)
        channels = OutputChannels(abort=group.abort, on_finished=group.forget)
        submit(group, channels, "a", request(0, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
        first_reader = channels.read("a")
        early = await anext(first_reader)
        await asyncio.sleep(0.02)  # deltas pile up unread
        late = await read_until_done(channels, "a", 1)  # takes over
        assert await anext(first_reader, None) is None  # the old reader ended
        return early + [item for batch in late for item in batch]

    items = asyncio.run(main())
    tokens = [t for item in items for t in item.new_token_ids]
    assert len(tokens) == 20 and items[-1].finish_reason is FinishReason.LENGTH


def test_an_unread_channel_gets_its_requests_aborted_and_is_dropped() -> None:
    now = [0.0]

    async def main():
        group = make_group(delay_s=0.001)
        channels = OutputChannels(abort=group.abort, on_finished=group.forget, orphan_after_s=10.0,
                                  clock=lambda: now[0])
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        for i in range(3):
            submit(group, channels, "gone", request(i, long))
        await asyncio.sleep(0.01)
        now[0] = 5.0
        assert channels.reap_orphans() == 0  # not for long enough yet
        now[0] = 11.0
        assert channels.reap_orphans() == 3
        assert "gone" not in channels.channels
        await asyncio.sleep(0.01)
        return group

    group = asyncio.run(main())
    status = group.status()
    assert status.num_unfinished_requests == 0 and status.num_running == 0
    assert_pool_full(group.engines[0].scheduler)


def test_a_failed_request_crosses_as_a_picklable_failure() -> None:
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    failure = failure_of("r1", Unpicklable("boom"))
    assert isinstance(failure.error, RuntimeError) and "Unpicklable: boom" in str(failure.error)
    kept = failure_of("r2", ValueError("bad"))
    assert isinstance(kept.error, ValueError)


def test_the_loop_delivers_a_step_after_handing_the_next_one_to_the_runner() -> None:
    """Overlap: step N's deltas are delivered only after step N+1 went to the runner."""
    log: list[str] = []

    class StartingRunner:
        """A runner with start(): the step is handed over (logged) when start() is called."""

        def __init__(self) -> None:
            self.fake = FakeRunner(CFG.block_size, CFG.num_blocks)

        def execute(self, scheduler_output):
            return self.fake.execute(scheduler_output)

        def start(self, scheduler_output):
            log.append("start")
            result = asyncio.get_running_loop().create_future()
            result.set_result(self.fake.execute(scheduler_output))
            return result

    async def main():
        engine = Engine(CFG, StartingRunner())
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.add_request(EngineRequest("r0", [1, 2, 3], params), lambda stream, item: log.append("deliver"))
        while engine.has_unfinished_requests() or log.count("deliver") < 4:
            await asyncio.sleep(0.001)

    asyncio.run(main())
    # 4 steps (prefill + token 1, then 3 decodes); the last has no successor to launch first
    assert log == ["start", "start", "deliver", "start", "deliver", "start", "deliver", "deliver"]


def test_overlapped_loop_gives_the_same_tokens_as_plain_steps() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=7), SamplingParams(temperature=0.9, seed=3, max_tokens=9),
              SamplingParams(temperature=0.0, max_tokens=4, n=3)]
    prompts = [list(range(5 * i, 5 * i + 3 + i)) for i in range(len(params))]
    looped = Engine(CFG, FakeRunner(CFG.block_size, CFG.num_blocks)).generate(prompts, params)

    scheduler = Scheduler(CFG)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        scheduler.add_request(EngineRequest(f"x{i}", prompt, sp))
    plain = run_steps(scheduler, FakeRunner(CFG.block_size, CFG.num_blocks))
    for i, result in enumerate(looped):
        for seq in result.sequences:
            key = (f"x{i}", seq.index)
            assert seq.token_ids == plain.tokens[key], key
