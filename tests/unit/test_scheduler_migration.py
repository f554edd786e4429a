"""take_requests_for_migration: a dead worker's requests continue elsewhere, streams intact."""

import pytest

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner, assert_pool_full, run_steps

CFG = SchedulerConfig(block_size=4, num_blocks=48, max_model_len=96, max_num_batched_tokens=24)


def requests():
    return [
        EngineRequest("long", list(range(500, 560)), SamplingParams(temperature=0.0, max_tokens=12)),
        EngineRequest("fork", list(range(10)), SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=15)),
        *(EngineRequest(f"r{i}", list(range(i * 7, i * 7 + 5 + i)), SamplingParams(temperature=0.0, max_tokens=10 + i))
          for i in range(6)),
    ]


def reference():
    s = Scheduler(CFG)
    for q in requests():
        s.add_request(q)
    return run_steps(s, FakeRunner(CFG.block_size, CFG.num_blocks))


@pytest.mark.parametrize("cut", [0, 1, 2, 4, 9, 20])
@pytest.mark.parametrize("in_flight", [False, True])
def test_migrated_streams_continue_without_duplicate_or_gap(cut, in_flight):
    expected = reference()
    dead = Scheduler(CFG)
    for q in requests():
        dead.add_request(q)
    t = run_steps(dead, FakeRunner(CFG.block_size, CFG.num_blocks), num_steps=cut)
    if in_flight:
        dead.schedule()  # the worker dies during this step: its tokens never arrive
    moved = dead.take_requests_for_migration()
    assert_pool_full(dead)
    assert not dead.has_unfinished_requests()
    assert [m.arrival_time for m in moved] == sorted(m.arrival_time for m in moved)
    live = Scheduler(CFG)
    for request in moved:
        live.add_migrated_request(request)
    run_steps(live, FakeRunner(CFG.block_size, CFG.num_blocks), t)
    assert_pool_full(live)
    assert t.tokens == expected.tokens and t.finish_reasons == expected.finish_reasons


def test_restarted_scheduler_accepts_new_work_after_migration():
    s = Scheduler(CFG)
    for q in requests():
        s.add_request(q)
    run_steps(s, FakeRunner(CFG.block_size, CFG.num_blocks), num_steps=3)
    s.take_requests_for_migration()
    assert s.kv.num_matched_tokens(s.block_hasher.hash_tokens(list(range(500, 560)))) == 0  # cache gone
    for q in requests():
        s.add_request(q)
    t = run_steps(s, FakeRunner(CFG.block_size, CFG.num_blocks))  # the worker came back empty
    assert t.tokens == reference().tokens
