"""Async scheduling: step N+1 decided before step N's tokens are known (Scheduler.schedule_ahead).

The FakeRunner checks every step as a real worker would (progress, block tables, the KV each
position reads), so a step that runs on a token or a block the worker does not have fails here.
"""

import random

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest, FinishReason
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import AheadDriver, FakeRunner, assert_pool_full, run_steps


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


def run(requests, ahead, eos=(), **kw):
    """Runs the requests to the end; returns the AheadDriver (ahead) or the Transcript."""
    s, runner = make(eos, **kw)
    for request in requests:
        s.add_request(request)
    if ahead:
        result = AheadDriver(s, runner)
        while result.busy:
            result.step()
    else:
        result = run_steps(s, runner)
    assert_pool_full(s)
    return result


def run_ahead(requests, eos=(), **kw):
    return run(requests, True, eos, **kw)


def run_sync(requests, eos=(), **kw):
    return run(requests, False, eos, **kw)


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
