"""Prefill batching while streams decode (SchedulerConfig.waiting_served_ratio, max_waiting_steps).

Every step that computes a prompt makes each running stream's next token late. Holding new
requests while sequences run, until enough wait or the oldest has waited max_waiting_steps,
lets arrivals that come a step or two apart share one such step.
"""

import pytest

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import AheadDriver, FakeRunner, assert_pool_full, run_steps
from tests.unit.test_scheduler_ahead import mixed_requests


def make(**kw):
    cfg = SchedulerConfig(**{"block_size": 4, "num_blocks": 128, "max_model_len": 128,
                             "max_num_batched_tokens": 64, **kw})
    return Scheduler(cfg), FakeRunner(cfg.block_size, cfg.num_blocks, vocab_size=200)


def req(rid, prompt_len, max_tokens):
    first = 1 + 100 * sum(map(ord, rid))  # a prompt of its own: no prefix hits between tests' requests
    return EngineRequest(rid, list(range(first, first + prompt_len)),
                         SamplingParams(temperature=0.0, max_tokens=max_tokens))


def step(s, runner):
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    return out


def start_four_decoding(s, runner):
    for i in range(4):
        s.add_request(req(f"run{i}", 8, max_tokens=40))
    step(s, runner)  # all four prompts in one step
    assert s.num_running_seqs == 4 and not s.waiting


def prompt_steps(runner, first_rid="new"):
    """Indexes of the steps that computed a new request's prompt."""
    return [i for i, scheduled in enumerate(runner.scheduled_history)
            if any(rid.startswith(first_rid) and n > 1 for rid, n in scheduled.items())]


def test_a_lone_arrival_beside_running_streams_waits_at_most_max_waiting_steps():
    s, runner = make(waiting_served_ratio=0.5, max_waiting_steps=3)
    start_four_decoding(s, runner)
    s.add_request(req("new0", 8, max_tokens=4))
    held = [step(s, runner) for _ in range(3)]
    assert all("new0" not in out.num_scheduled_tokens for out in held)  # 1 < 0.5 * 4 running
    assert s.waiting[0].request_id == "new0"
    assert step(s, runner).num_scheduled_tokens["new0"] == 8  # waited 3 steps: admitted
    run_steps(s, runner)
    assert_pool_full(s)


def test_enough_arrivals_are_admitted_at_once():
    s, runner = make(waiting_served_ratio=0.5, max_waiting_steps=100)
    start_four_decoding(s, runner)
    s.add_request(req("new0", 8, max_tokens=4))
    assert "new0" not in step(s, runner).num_scheduled_tokens
    s.add_request(req("new1", 8, max_tokens=4))  # 2 >= 0.5 * 4 running
    out = step(s, runner)
    assert out.num_scheduled_tokens["new0"] == out.num_scheduled_tokens["new1"] == 8


def test_an_idle_worker_admits_the_first_arrival_at_once():
    s, runner = make(waiting_served_ratio=10.0, max_waiting_steps=100)
    s.add_request(req("new0", 8, max_tokens=2))
    assert step(s, runner).num_scheduled_tokens == {"new0": 8}


def test_arrivals_a_step_apart_cost_the_running_streams_one_prompt_step_not_one_each():
    def arrivals_one_per_step(**kw):
        s, runner = make(**kw)
        start_four_decoding(s, runner)
        for i in range(4):
            s.add_request(req(f"new{i}", 8, max_tokens=4))
            step(s, runner)
        run_steps(s, runner)
        assert_pool_full(s)
        return runner

    assert len(prompt_steps(arrivals_one_per_step())) == 4  # vLLM's rule: a stall per arrival
    assert len(prompt_steps(arrivals_one_per_step(waiting_served_ratio=1.0, max_waiting_steps=100))) == 1


def test_a_migrated_request_is_not_held():
    """It was running on a worker that died: its stream is already waiting for tokens."""
    old, old_runner = make()
    old.add_request(req("moved", 8, max_tokens=10))
    for _ in range(3):
        step(old, old_runner)
    [moved] = old.take_requests_for_migration()
    s, runner = make(waiting_served_ratio=100.0, max_waiting_steps=100)
    start_four_decoding(s, runner)
    s.add_migrated_request(moved)
    assert step(s, runner).num_scheduled_tokens["moved"] == 8 + 3  # its prompt and the 3 tokens it sampled
    run_steps(s, runner)
    assert_pool_full(s)


def arrivals_transcript(ahead: bool, seed: int, **kw):
    """20 mixed requests arriving one every third step, driven synchronously or ahead (async
    scheduling): the transcript of what they sampled, and the runner (its step history)."""
    s, runner = make(**kw)
    pending = mixed_requests(20, seed=seed)
    driver = AheadDriver(s, runner)
    num_steps = 0
    while pending or driver.busy:
        if pending and num_steps % 3 == 0:
            s.add_request(pending.pop(0))  # an arrival every third step
        num_steps += 1
        if ahead:
            driver.step()
        else:
            driver.transcript.record(s.update_from_output(out := s.schedule(), runner.execute(out)))
    assert_pool_full(s)
    return driver.transcript, runner


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_holding_changes_when_tokens_come_never_which(ahead):
    held, held_runner = arrivals_transcript(ahead, 11, waiting_served_ratio=1.0, max_waiting_steps=5)
    free, free_runner = arrivals_transcript(ahead, 11)
    assert held.tokens == free.tokens and held.finish_reasons == free.finish_reasons
    assert len(prompt_steps(held_runner, "r")) < len(prompt_steps(free_runner, "r"))


def test_arrivals_left_over_by_a_full_prompt_budget_are_not_held():
    """Twelve prompts arrive together beside four streams; the step's budget takes seven and a
    half. The rest were part of that batch, so they follow at the next step instead of waiting
    behind it (then to stall all of its streams at once)."""
    s, runner = make(waiting_served_ratio=1.0, max_waiting_steps=100)
    start_four_decoding(s, runner)
    for i in range(12):
        s.add_request(req(f"new{i:02d}", 8, max_tokens=40))
    first = step(s, runner)
    assert sum(n for rid, n in first.num_scheduled_tokens.items() if rid.startswith("new")) == 64 - 4
    assert len(s.waiting) == 4  # 4 < 1.0 x 12 running: the ratio alone would hold them
    second = step(s, runner)
    assert all(f"new{i:02d}" in second.num_scheduled_tokens for i in range(8, 12))  # the last two in part
    s.add_request(req("late", 8, max_tokens=4))  # arrived after that batch: held as before
    assert "late" not in step(s, runner).num_scheduled_tokens
    run_steps(s, runner)
    assert_pool_full(s)


def start_four_finishing(s, runner, max_tokens=(3, 3, 3, 3)):
    """Four sequences decoding; request i ends after max_tokens[i] tokens (one sampled already)."""
    for i, limit in enumerate(max_tokens):
        s.add_request(req(f"run{i}", 8, max_tokens=limit))
    step(s, runner)
    assert s.num_running_seqs == 4 and not s.waiting


def test_new_requests_wait_for_streams_about_to_end():
    """Half a wave ended, its clients' next requests arrived, the other half has 2 tokens to go:
    the new prompts wait for them instead of stalling their last tokens."""
    s, runner = make(waiting_served_ratio=0.3, max_waiting_steps=100, hold_while_finishing_steps=4)
    start_four_finishing(s, runner)
    for i in range(4):
        s.add_request(req(f"new{i}", 8, max_tokens=4))  # 4 >= 0.3 x 4 running: the ratio alone admits them
    held = [step(s, runner) for _ in range(2)]
    assert [sorted(out.num_scheduled_tokens) for out in held] == [[f"run{i}" for i in range(4)]] * 2
    assert s.num_running_seqs == 0  # the four ended...
    assert step(s, runner).num_scheduled_tokens == {f"new{i}": 8 for i in range(4)}  # ...then the prompts
    run_steps(s, runner)
    assert_pool_full(s)


@pytest.mark.parametrize("finishing_steps, max_tokens", [(0, (3, 3, 3, 3)), (4, (3, 40, 40, 40))],
                         ids=["setting-off", "one-of-four-ending"])
def test_new_requests_are_admitted_at_once(finishing_steps, max_tokens):
    """With the setting off, or with only one of four streams about to end (most go on, so
    waiting gains nothing), arrivals the ratio admits go in at the next step."""
    s, runner = make(waiting_served_ratio=0.3, max_waiting_steps=100, hold_while_finishing_steps=finishing_steps)
    start_four_finishing(s, runner, max_tokens)
    for i in range(4):
        s.add_request(req(f"new{i}", 8, max_tokens=4))
    out = step(s, runner)
    assert all(out.num_scheduled_tokens.get(f"new{i}") == 8 for i in range(4))


def test_waiting_for_streams_about_to_end_stops_at_max_waiting_steps():
    s, runner = make(waiting_served_ratio=0.3, max_waiting_steps=1, hold_while_finishing_steps=4)
    start_four_finishing(s, runner, max_tokens=(5, 5, 5, 5))
    for i in range(4):
        s.add_request(req(f"new{i}", 8, max_tokens=4))
    assert "new0" not in step(s, runner).num_scheduled_tokens
    out = step(s, runner)  # waited 1 step: admitted beside the two streams' last tokens
    assert out.num_scheduled_tokens["new0"] == 8 and "run0" in out.num_scheduled_tokens
    run_steps(s, runner)
    assert_pool_full(s)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_waiting_for_streams_about_to_end_changes_when_tokens_come_never_which(ahead):
    held, held_runner = arrivals_transcript(ahead, 12, waiting_served_ratio=0.3, max_waiting_steps=8,
                                            hold_while_finishing_steps=6)
    ratio_only, ratio_runner = arrivals_transcript(ahead, 12, waiting_served_ratio=0.3, max_waiting_steps=8)
    free, _ = arrivals_transcript(ahead, 12)
    assert held.tokens == ratio_only.tokens == free.tokens
    assert held.finish_reasons == ratio_only.finish_reasons == free.finish_reasons
    assert prompt_steps(held_runner, "r") != prompt_steps(ratio_runner, "r")  # the setting did hold some


def test_an_arrival_joins_a_batch_that_has_just_started():
    """A burst's late member (its request took longer to reach us) arrives while the burst's
    prompts are computed. Held, it would start max_waiting_steps behind the burst and end that
    far behind it; it joins at the next step instead. Once most of the batch has sampled
    hold_while_finishing_steps tokens, an arrival is held as before."""
    s, runner = make(waiting_served_ratio=0.3, max_waiting_steps=100, hold_while_finishing_steps=4)
    for i in range(8):
        s.add_request(req(f"run{i}", 8, max_tokens=40))
    step(s, runner)  # the burst's eight prompts; each has sampled one token
    s.add_request(req("late", 8, max_tokens=40))  # 1 < 0.3 x 8 running: the ratio alone would hold it
    assert step(s, runner).num_scheduled_tokens["late"] == 8
    for _ in range(3):
        step(s, runner)  # the burst has sampled 5 tokens, "late" 4
    s.add_request(req("next", 8, max_tokens=4))
    held = [step(s, runner) for _ in range(3)]
    assert all("next" not in out.num_scheduled_tokens for out in held)
    run_steps(s, runner)
    assert_pool_full(s)

