"""Abort in every state, and n>1 forking (prompt computed once, children independent)."""

import pytest

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest, FinishReason
from scheduler.request import RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner, Transcript, assert_consistent, assert_pool_full, run_steps


def setup(eos=(), **kw):
    cfg = SchedulerConfig(**{"block_size": 4, "num_blocks": 64, "max_model_len": 128, **kw})
    return Scheduler(cfg, eos_token_ids=eos), FakeRunner(cfg.block_size, cfg.num_blocks)


def req(rid, prompt, **params):
    return EngineRequest(rid, list(prompt), SamplingParams(**{"temperature": 0.0, **params}))


def step(s, r, t):
    out = s.schedule()
    t.record(s.update_from_output(out, r.execute(out)))
    assert_consistent(s)
    return out


def finish_all(s, r, t):
    run_steps(s, r, t)
    assert_pool_full(s)
    step_empty = s.schedule()
    assert step_empty.is_empty


# --- abort -------------------------------------------------------------------------------
def test_abort_waiting_running_midchunk_and_decoding():
    s, r = setup(max_num_batched_tokens=16)
    s.add_request(req("decoding", range(4), max_tokens=50))
    s.add_request(req("chunking", range(100, 140), max_tokens=50))
    s.add_request(req("waiting", range(200, 210), max_tokens=50))
    t = Transcript()
    step(s, r, t)
    step(s, r, t)
    assert s.requests["decoding"].num_output_tokens == 2
    assert 0 < s.requests["chunking"].num_computed_tokens < 40  # mid-chunk
    assert s.requests["waiting"].status == RequestStatus.WAITING
    used = s.kv.pool.num_used_blocks
    finals = s.abort_request(["chunking"])
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in finals] == [("chunking", FinishReason.ABORT, [])]
    assert s.kv.pool.num_used_blocks < used  # freed at once
    assert s.abort_request("waiting")[0].finish_reason == FinishReason.ABORT
    assert s.abort_request("decoding")[0].finish_reason == FinishReason.ABORT
    assert s.abort_request("unknown") == []
    assert_pool_full(s)
    out = s.schedule()  # nothing left to run: the worker learns on the next real step
    assert out.is_empty
    s.add_request(req("next", range(5), max_tokens=1))
    out = s.schedule()
    assert out.finished_request_ids == {"decoding", "chunking"}  # "waiting" never reached it
    r.execute(out)
    assert set(r.requests) == {"next"}


def test_abort_preempted_request_and_while_step_in_flight():
    s, r = setup(max_num_batched_tokens=64, num_blocks=9, max_model_len=32)
    for i in range(3):
        s.add_request(req(f"r{i}", range(i * 50, i * 50 + 12), max_tokens=20))
    t = run_steps(s, r, until=lambda s: s.totals.num_preemptions > 0)
    victim = next(q for q in s.waiting if q.status == RequestStatus.PREEMPTED)
    s.abort_request(victim.client_request_id)
    out = s.schedule()
    running = next(iter(out.num_scheduled_tokens))
    s.abort_request(running)  # the worker is computing it right now
    runner_out = r.execute(out)
    outputs = s.update_from_output(out, runner_out)
    assert running not in {o.request_id for o in outputs}
    t.record(outputs)
    finish_all(s, r, t)


def test_abort_fork_parent_before_and_children_after_fork():
    s, r = setup()
    s.add_request(req("p", range(10), n=3, max_tokens=20))
    finals = s.abort_request("p")  # waiting: one final per sequence
    assert sorted(o.index for o in finals) == [0, 1, 2] and all(o.request_id == "p" for o in finals)
    s.add_request(req("q", range(10), n=3, max_tokens=20))
    t = Transcript()
    step(s, r, t)
    step(s, r, t)  # forked and one token each
    assert sorted(s.requests) == ["q-0", "q-1", "q-2"]
    finals = s.abort_request("q")
    assert sorted((o.request_id, o.index) for o in finals) == [("q", 0), ("q", 1), ("q", 2)]
    assert_pool_full(s)


# --- n > 1 ------------------------------------------------------------------------------
def run_fork(prompt_len, n, params, **kw):
    s, r = setup(**kw)
    s.add_request(req("p", range(100, 100 + prompt_len), n=n, **params))
    t = run_steps(s, r)
    assert_pool_full(s)
    return t, s, r


@pytest.mark.parametrize("prompt_len", [10, 9, 1])  # partial last block, boundary, nothing to share
def test_greedy_children_identical_and_prompt_computed_once(prompt_len):
    t, s, r = run_fork(prompt_len, 4, {"max_tokens": 6})
    seqs = [t.tokens[("p", i)] for i in range(4)]
    assert all(x == seqs[0] for x in seqs) and len(seqs[0]) == 6
    single, _, _ = run_fork(prompt_len, 1, {"max_tokens": 6})
    assert single.tokens[("p", 0)] == seqs[0]
    if prompt_len > 1:
        assert r.num_computed_per_request["p"] == prompt_len - 1
        assert s.totals.num_prompt_tokens_computed == prompt_len - 1 + 4  # vs 4 * prompt_len apart
    assert len(r.copies) == (4 if (prompt_len - 1) % 4 else 0)
    assert {o.request_id for o in t.outputs} == {"p"}


def test_seeded_children_differ_and_are_reproducible():
    params = {"temperature": 1.0, "seed": 11, "max_tokens": 8}
    a, _, _ = run_fork(10, 4, params)
    b, _, _ = run_fork(10, 4, params, max_num_batched_tokens=3, num_blocks=20, max_model_len=64)  # other batching
    assert a.tokens == b.tokens
    assert len({tuple(a.tokens[("p", i)]) for i in range(4)}) == 4
    # child i samples like a single request seeded seed + i
    single, _, _ = run_fork(10, 1, {**params, "seed": 13})
    assert single.tokens[("p", 0)] == a.tokens[("p", 2)]


def test_children_finish_independently():
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 8}
    probe, _, _ = run_fork(10, 3, params)
    eos = probe.tokens[("p", 1)][2]
    t, _, _ = run_fork(10, 3, params, eos=[eos])
    assert t.finish_reasons[("p", 1)] == FinishReason.STOP and len(t.tokens[("p", 1)]) <= 3
    for i in (0, 2):
        expected = probe.tokens[("p", i)]
        cut = expected.index(eos) + 1 if eos in expected else len(expected)
        assert t.tokens[("p", i)] == expected[:cut]


def test_fork_under_tiny_pool_with_preemption():
    params = {"temperature": 1.0, "seed": 2, "max_tokens": 30}
    big, _, _ = run_fork(14, 4, params)
    s, r = setup(num_blocks=17, max_model_len=64)
    s.add_request(req("p", range(100, 114), n=4, **params))
    s.add_request(req("x", range(300, 320), max_tokens=30))
    t = run_steps(s, r)
    assert_pool_full(s)
    assert s.totals.num_preemptions > 0
    assert {k: v for k, v in t.tokens.items() if k[0] == "p"} == big.tokens
