"""Property: after any sequence of add/step/abort/migrate and then finishing, the pool is full,
with steps scheduled after the last one landed or ahead of it (async scheduling); and, for a
model with recurrent layers, every step continues each request's own state (FakeRunner's
recurrent mode: forks, snapshots saved and restored on prefix hits)."""

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import AheadDriver, FakeRunner, Transcript, assert_consistent, assert_pool_full, run_steps

CFG = SchedulerConfig(block_size=4, num_blocks=13, max_model_len=48, max_num_batched_tokens=16, max_num_seqs=6)
PREFIXES = [list(range(100, 124)), list(range(200, 212)), []]

add = st.tuples(
    st.just("add"),
    st.integers(1, 30),  # prompt length
    st.integers(1, 30),  # max_tokens
    st.sampled_from([1, 1, 2, 3]),  # n
    st.integers(0, 2),  # shared prefix family
    st.booleans(),  # seeded sampling
)
ops = st.lists(
    st.one_of(add, add, st.tuples(st.just("step"), st.integers(1, 12)), st.tuples(st.just("abort"), st.integers(0, 50)),
              st.tuples(st.just("migrate"))),
    max_size=60,
)


def add_request(s, k, op):
    _, length, max_tokens, n, family, seeded = op
    prompt = (PREFIXES[family] + list(range(k, k + length)))[:length]
    params = SamplingParams(temperature=0.8 if seeded else 0.0, seed=k if seeded else None, n=n, max_tokens=max_tokens)
    s.add_request(EngineRequest(f"c{k}", prompt, params))
    return f"c{k}"


def config_and_runner(wait, recurrent):
    """The scheduler's config, and a function giving a fresh worker for it."""
    config = replace(CFG, min_shared_prefix_to_wait=wait, recurrent_state=recurrent, num_state_snapshots=3)
    return config, lambda: FakeRunner(CFG.block_size, CFG.num_blocks, vocab_size=50, recurrent=recurrent)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, drain=st.sampled_from(["run", "abort"]), wait=st.sampled_from([None, 4]), recurrent=st.booleans())
def test_pool_is_full_again_after_any_sequence(ops, drain, wait, recurrent):
    config, new_runner = config_and_runner(wait, recurrent)
    s = Scheduler(config, eos_token_ids=[3])
    runner = new_runner()  # EOS now and then
    t = Transcript()
    added: list[str] = []
    for k, op in enumerate(ops):
        if op[0] == "add":
            added.append(add_request(s, k, op))
        elif op[0] == "step":
            run_steps(s, runner, t, num_steps=op[1])
        elif op[0] == "abort" and added:
            t.record(s.abort_request(added[op[1] % len(added)]))
        elif op[0] == "migrate":
            moved = s.take_requests_for_migration()
            assert_pool_full(s)
            runner = new_runner()  # the worker restarted
            for request in moved:
                s.add_migrated_request(request)
        assert_consistent(s)
    if drain == "abort":
        t.record(s.abort_request(added))
    else:
        run_steps(s, runner, t)
    assert_pool_full(s)
    assert not s.has_unfinished_requests() and s.num_running_seqs == 0
    # every sequence of every request ended exactly once (record() rejects deltas after the end)
    expected = {(cid, i) for k, cid in enumerate(added) for i in range(_n_of(ops, cid))}
    assert set(t.finish_reasons) == expected


def _n_of(ops, cid):
    return ops[int(cid[1:])][3]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, drain=st.sampled_from(["run", "abort"]), wait=st.sampled_from([None, 4]), recurrent=st.booleans())
def test_pool_is_full_again_after_any_sequence_with_a_step_always_ahead(ops, drain, wait, recurrent):
    """Adds, aborts and worker deaths land while a step decided ahead is still to run."""
    config, new_runner = config_and_runner(wait, recurrent)
    s = Scheduler(config, eos_token_ids=[3])
    driver = AheadDriver(s, new_runner(), Transcript())
    added: list[str] = []
    for k, op in enumerate(ops):
        if op[0] == "add":
            added.append(add_request(s, k, op))
        elif op[0] == "step":
            for _ in range(op[1]):
                if driver.busy:
                    driver.step()
        elif op[0] == "abort" and added:
            driver.transcript.record(s.abort_request(added[op[1] % len(added)]))
        elif op[0] == "migrate":
            moved = s.take_requests_for_migration()
            assert_pool_full(s)
            driver.forget_step(new_runner())
            for request in moved:
                s.add_migrated_request(request)
        assert_consistent(s)
    if drain == "abort":
        driver.transcript.record(s.abort_request(added))
    while driver.busy:
        driver.step()
    assert_pool_full(s)
    assert not s.has_unfinished_requests() and s.num_running_seqs == 0
