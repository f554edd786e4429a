"""Async scheduling: step N+1 decided before step N's tokens are known (Scheduler.schedule_ahead).

The FakeRunner checks every step as a real worker would (progress, block tables, the KV each
position reads), so a step that runs on a token or a block the worker does not have fails here.
"""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest, FinishReason
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import AheadDriver, FakeRunner, Transcript, assert_consistent, assert_pool_full, run_steps


def make(eos=(), **kw):
    cfg = SchedulerConfig(**{"block_size": 4, "num_blocks": 64, "max_model_len": 128, **kw})
    return Scheduler(cfg, eos_token_ids=eos), FakeRunner(cfg.block_size, cfg.num_blocks, vocab_size=200)


def mixed_requests(num, seed):
    rng = random.Random(seed)
    requests = []
    for i in range(num):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 50))]
        seeded = rng.random() < 0.5
        params = SamplingParams(temperature=0.9 if seeded else 0.0, seed=i if seeded else None,
                                n=rng.choice([1, 1, 1, 2, 3]), max_tokens=rng.randint(1, 20))
        requests.append(EngineRequest(f"r{i}", prompt, params))
    return requests


def run_ahead(requests, eos=(), **kw):
    s, runner = make(eos, **kw)
    for request in requests:
        s.add_request(request)
    driver = AheadDriver(s, runner)
    while driver.busy:
        driver.step()
    assert_pool_full(s)
    return driver


def run_sync(requests, eos=(), **kw):
    s, runner = make(eos, **kw)
    for request in requests:
        s.add_request(request)
    t = run_steps(s, runner)
    assert_pool_full(s)
    return t


def test_outputs_equal_the_synchronous_schedule_and_most_steps_are_decided_ahead():
    requests = mixed_requests(24, seed=5)
    sync = run_sync(requests, eos=[3], max_num_batched_tokens=24, max_num_seqs=8)
    driver = run_ahead(requests, eos=[3], max_num_batched_tokens=24, max_num_seqs=8)
    assert driver.transcript.tokens == sync.tokens
    assert driver.transcript.finish_reasons == sync.finish_reasons
    assert driver.num_ahead >= driver.transcript.num_steps // 2, (driver.num_ahead, driver.transcript.num_steps)


def test_a_lone_decode_never_waits_for_its_own_token():
    driver = run_ahead([EngineRequest("a", list(range(10)), SamplingParams(temperature=0.0, max_tokens=8))])
    # prefill+first token, then 7 decodes: every step after the first was decided ahead
    # (the last one is not scheduled: max_tokens ends the request when the step before lands)
    assert driver.transcript.num_steps == 8
    assert driver.num_ahead == 7
    assert len(driver.transcript.tokens[("a", 0)]) == 8


def test_a_stop_token_wastes_one_position_and_no_delta_follows_the_final_one():
    s, runner = make(eos=[])

    def next_token(digest, params, position):  # token 7 at output position 2: the stop token
        return 7 if position == 2 else 11

    runner.next_token_fn = next_token
    s.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[7])))
    driver = AheadDriver(s, runner)
    while driver.busy:
        driver.step()
    assert driver.transcript.tokens[("a", 0)] == [11, 11, 7]
    assert driver.transcript.finish_reasons[("a", 0)] == FinishReason.STOP
    assert runner.num_computed_per_request["a"] == 3 + 3  # prompt, two decodes, one wasted position
    assert_pool_full(s)


def test_a_short_pool_falls_back_to_a_synchronous_step_that_preempts():
    requests = [EngineRequest(f"r{i}", list(range(i, i + 14)), SamplingParams(temperature=0.0, max_tokens=30))
                for i in range(4)]
    sync = run_sync(requests, num_blocks=24, max_model_len=48)
    driver = run_ahead(requests, num_blocks=24, max_model_len=48)
    assert driver.transcript.tokens == sync.tokens
    assert driver.num_ahead < driver.transcript.num_steps  # some steps waited for the landing


CFG = SchedulerConfig(block_size=4, num_blocks=13, max_model_len=48, max_num_batched_tokens=16, max_num_seqs=6)
PREFIXES = [list(range(100, 124)), list(range(200, 212)), []]
add = st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 30), st.sampled_from([1, 1, 2, 3]),
                st.integers(0, 2), st.booleans())
ops = st.lists(
    st.one_of(add, add, st.tuples(st.just("step"), st.integers(1, 12)), st.tuples(st.just("abort"), st.integers(0, 50)),
              st.tuples(st.just("migrate"))),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, drain=st.sampled_from(["run", "abort"]))
def test_pool_is_full_again_after_any_sequence_with_a_step_always_ahead(ops, drain):
    """Adds, aborts and worker deaths land while a step decided ahead is still to run."""
    s = Scheduler(CFG, eos_token_ids=[3])
    driver = AheadDriver(s, FakeRunner(CFG.block_size, CFG.num_blocks, vocab_size=50), Transcript())
    added: list[str] = []
    for k, op in enumerate(ops):
        if op[0] == "add":
            _, length, max_tokens, n, family, seeded = op
            prompt = (PREFIXES[family] + list(range(k, k + length)))[:length]
            params = SamplingParams(temperature=0.8 if seeded else 0.0, seed=k if seeded else None, n=n,
                                    max_tokens=max_tokens)
            s.add_request(EngineRequest(f"c{k}", prompt, params))
            added.append(f"c{k}")
        elif op[0] == "step":
            for _ in range(op[1]):
                if driver.busy:
                    driver.step()
        elif op[0] == "abort" and added:
            driver.transcript.record(s.abort_request(added[op[1] % len(added)]))
        elif op[0] == "migrate":
            moved = s.take_requests_for_migration()
            assert_pool_full(s)
            driver.forget_step(FakeRunner(CFG.block_size, CFG.num_blocks, vocab_size=50))
            for request in moved:
                s.add_migrated_request(request)
        assert_consistent(s)
    if drain == "abort":
        driver.transcript.record(s.abort_request(added))
    while driver.busy:
        driver.step()
    assert_pool_full(s)
    assert not s.has_unfinished_requests() and s.num_running_seqs == 0
