"""Scheduler with FakeRunner: budget, chunked prefill, mixed batches, prefix hits, preemption."""

import random

import pytest

from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest, FinishReason
from scheduler.request import RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.testing import FakeRunner, Transcript, assert_pool_full, run_steps, run_to_end



def setup(eos=(), **kw):
    cfg = SchedulerConfig(**{"block_size": 4, "num_blocks": 64, "max_model_len": 128, **kw})
    return Scheduler(cfg, eos_token_ids=eos), FakeRunner(cfg.block_size, cfg.num_blocks)


def req(rid, prompt, **params):
    return EngineRequest(rid, list(prompt), SamplingParams(**{"temperature": 0.0, **params}))


def random_requests(n, seed=0, max_prompt=60, max_tokens=20):
    rng = random.Random(seed)
    return [
        req(f"r{i}", [rng.randrange(1000) for _ in range(rng.randint(1, max_prompt))], max_tokens=rng.randint(1, max_tokens))
        for i in range(n)
    ]


def run(requests, **kw):
    s, r = setup(**kw)
    for q in requests:
        s.add_request(q)
    t = run_steps(s, r)
    assert_pool_full(s)
    return t, s, r


def test_budget_and_max_num_seqs_respected_every_step():
    t, s, r = run(random_requests(30), max_num_batched_tokens=24, max_num_seqs=5)
    assert all(sum(step.values()) <= 24 and len(step) <= 5 for step in r.scheduled_history)
    assert max(sum(step.values()) for step in r.scheduled_history) == 24
    assert len(t.finish_reasons) == 30


def test_concurrent_equals_alone():
    requests = random_requests(16, seed=3)
    together, _, _ = run(requests, max_num_batched_tokens=32)
    for q in requests:
        alone, _, _ = run([q])
        assert alone.tokens[(q.request_id, 0)] == together.tokens[(q.request_id, 0)]


def test_chunked_prefill_chunks_to_the_budget():
    t, s, r = run([req("a", range(50), max_tokens=3)], max_num_batched_tokens=16)
    assert [step["a"] for step in r.scheduled_history] == [16, 16, 16, 2, 1, 1]
    assert len(t.tokens[("a", 0)]) == 3


def test_long_prefill_threshold_caps_one_request():
    t, s, r = run([req("a", range(20), max_tokens=1), req("b", range(100, 120), max_tokens=1)],
                  max_num_batched_tokens=16, long_prefill_token_threshold=6)
    assert r.scheduled_history[0] == {"a": 6, "b": 6}


def test_short_prompts_arriving_together_share_a_step_while_a_long_one_is_chunked():
    # the shipped shape, scaled down: budget 4x the per-prompt threshold
    shorts = [req(f"s{i}", range(1000 * i, 1000 * i + 8), max_tokens=1) for i in range(4)]
    t, s, r = run(shorts + [req("long", range(5000, 5040), max_tokens=1)],
                  max_num_batched_tokens=40, long_prefill_token_threshold=10, num_blocks=200)
    first = r.scheduled_history[0]
    assert all(first[f"s{i}"] == 8 for i in range(4))  # every short prompt whole, in one step
    assert first["long"] == 8  # what the budget leaves; never more than 10 a step
    assert all(step.get("long", 0) <= 10 for step in r.scheduled_history)


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    s, r = setup(max_num_batched_tokens=128, enable_chunked_prefill=False)
    s.add_request(req("a", range(100), max_tokens=2))
    s.add_request(req("b", range(200, 250), max_tokens=2))
    run_steps(s, r)
    assert r.scheduled_history[0] == {"a": 100}  # b (50) does not fit the 28 left
    assert r.scheduled_history[1] == {"a": 1, "b": 50}


def test_decodes_get_a_token_every_step_during_a_long_prefill():
    s, r = setup(max_num_batched_tokens=32, num_blocks=200, max_model_len=400)
    for i in range(3):
        s.add_request(req(f"d{i}", range(i * 10, i * 10 + 5), max_tokens=100))
    t = run_steps(s, r, until=lambda s: all(s.requests[f"d{i}"].num_output_tokens >= 2 for i in range(3)))
    s.add_request(req("long", range(500, 800), max_tokens=2))
    prefill_steps = 0
    while s.requests["long"].num_output_tokens == 0:
        before = {f"d{i}": s.requests[f"d{i}"].num_output_tokens for i in range(3)}
        out = s.schedule()
        t.record(s.update_from_output(out, r.execute(out)))
        assert all(s.requests[d].num_output_tokens == n + 1 for d, n in before.items())
        assert out.num_scheduled_tokens["long"] == 29 or s.requests["long"].num_output_tokens == 1
        prefill_steps += 1
    assert prefill_steps == -(-300 // 29)


def test_prefix_hit_starts_computed_and_reports_block_rounded_cached_tokens():
    shared = list(range(1000, 1030))  # 30 tokens: 7 full blocks of 4
    s, r = setup(max_num_batched_tokens=64)
    s.add_request(req("a", shared + [1, 2], max_tokens=4))
    t = run_steps(s, r)
    s.add_request(req("b", shared + [3, 4, 5], max_tokens=4))
    run_steps(s, r, t)
    assert t.num_cached_tokens == {"a": 0, "b": 28}
    new_b = r.scheduled_history[-4]
    assert new_b == {"b": 33 - 28}
    alone, _, _ = run([req("b", shared + [3, 4, 5], max_tokens=4)], enable_prefix_caching=False)
    assert alone.tokens[("b", 0)] == t.tokens[("b", 0)]
    assert s.totals.num_prefix_hit_tokens == 28 and s.totals.num_prefix_query_tokens == 32 + 33


@pytest.mark.parametrize("ahead", [False, True])
def test_requests_arriving_with_one_prefix_compute_it_once(ahead):
    # a shared 24-token prefix (6 blocks of 4) in chunks of 8: the followers wait for its blocks
    shared = list(range(1000, 1024))
    requests = [req("a", shared + [1, 2]), req("b", shared + [3]), req("other", range(50, 60)),
                req("c", shared + [4, 5, 6])]
    s, r = setup(max_num_batched_tokens=64, long_prefill_token_threshold=8, min_shared_prefix_to_wait=8)
    for q in requests:
        s.add_request(q)
    t = run_to_end(s, r, ahead)
    first = r.scheduled_history[0]
    assert first == {"a": 8, "other": 8}  # the followers are deferred, the unrelated one is not
    # they start in the step that computes a's last prompt tokens: decided ahead, while the
    # step that computes the last shared block runs, they take its blocks as landing hits
    assert [step.get("a") for step in r.scheduled_history[:4]] == [8, 8, 8, 2]
    assert not any("b" in step or "c" in step for step in r.scheduled_history[:3])
    assert r.scheduled_history[3]["b"] == 1 and r.scheduled_history[3]["c"] == 3
    assert t.num_cached_tokens == {"a": 0, "b": 24, "other": 0, "c": 24}
    prompt_tokens = sum(n for step in r.scheduled_history for n in step.values() if n > 1)
    assert prompt_tokens == 26 + 10 + 3  # a and other whole, c's 3 tokens past its hit (b's 1 looks like a decode)
    assert s.totals.num_prefix_hit_tokens == 48
    for q in requests:  # streams as if each ran alone, without a cache
        alone, _, _ = run([q], enable_prefix_caching=False)
        assert alone.tokens[(q.request_id, 0)] == t.tokens[(q.request_id, 0)]


@pytest.mark.parametrize("min_wait", [12, None])
def test_a_shared_run_shorter_than_min_shared_prefix_to_wait_is_computed_twice(min_wait):
    # the owner schedules 8 tokens (2 blocks) of the 24 it shares with the follower
    shared = list(range(1000, 1024))
    s, r = setup(max_num_batched_tokens=64, long_prefill_token_threshold=8, min_shared_prefix_to_wait=min_wait)
    s.add_request(req("a", shared + [1]))
    s.add_request(req("b", shared + [2]))
    t = run_steps(s, r)
    assert r.scheduled_history[0] == {"a": 8, "b": 8}
    assert t.num_cached_tokens == {"a": 0, "b": 0}


def test_a_deferred_request_runs_when_the_owner_of_its_prefix_is_aborted():
    shared = list(range(1000, 1024))
    s, r = setup(max_num_batched_tokens=64, long_prefill_token_threshold=8, min_shared_prefix_to_wait=8)
    s.add_request(req("a", shared + [1]))
    s.add_request(req("b", shared + [2], max_tokens=3))
    t = run_steps(s, r, num_steps=1)
    assert r.scheduled_history[0] == {"a": 8}
    s.abort_request("a")
    run_steps(s, r, t)
    assert r.scheduled_history[1] == {"b": 8} and t.num_cached_tokens["b"] == 8  # what a computed before it went
    assert len(t.tokens[("b", 0)]) == 3


def test_a_follower_takes_no_landing_blocks_of_an_owner_aborted_while_its_step_runs():
    shared = list(range(1000, 1024))
    s, r = setup(max_num_batched_tokens=64, long_prefill_token_threshold=8, min_shared_prefix_to_wait=8)
    s.add_request(req("a", shared + [1]))
    s.add_request(req("b", shared + [2], max_tokens=3))
    s.add_request(req("c", range(2000, 2030), max_tokens=3))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 8, "c": 8}
    s.abort_request("a")  # its blocks are freed while the step that fills them is in flight
    ahead = s.schedule_ahead()  # c's next chunk may take a's freed blocks: b must not read them
    assert ahead.num_scheduled_tokens == {"c": 8, "b": 8}
    t = Transcript()
    t.record(s.update_from_output(first, r.execute(first)))
    t.record(s.update_from_output(ahead, r.execute(ahead)))  # the runner checks every KV read
    run_steps(s, r, t)
    assert t.num_cached_tokens["b"] == 0
    alone, _, _ = run([req("b", shared + [2], max_tokens=3)], enable_prefix_caching=False)
    assert alone.tokens[("b", 0)] == t.tokens[("b", 0)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preemption_under_tiny_pool_gives_identical_streams(seed):
    requests = random_requests(24, seed=seed, max_prompt=40, max_tokens=40)
    big, _, _ = run(requests, max_num_batched_tokens=48, num_blocks=400)
    tiny, s, _ = run(requests, max_num_batched_tokens=48, num_blocks=33)
    assert s.totals.num_preemptions > 0
    assert tiny.tokens == big.tokens and tiny.finish_reasons == big.finish_reasons


def test_preempted_request_goes_to_the_front_of_waiting():
    s, r = setup(max_num_batched_tokens=64, num_blocks=9, max_model_len=32)  # 8 usable blocks
    s.add_request(req("old", range(12), max_tokens=20))
    s.add_request(req("new", range(100, 112), max_tokens=20))
    s.add_request(req("late", range(200, 212), max_tokens=20))
    t = run_steps(s, r, until=lambda s: s.totals.num_preemptions > 0)
    assert [q.request_id for q in s.waiting][:1] == ["new"] and s.requests["new"].status == RequestStatus.PREEMPTED
    run_steps(s, r, t)
    assert_pool_full(s)
    for rid in ("old", "new", "late"):
        assert len(t.tokens[(rid, 0)]) == 20


def test_stop_conditions():
    probe, _, _ = run([req("a", range(10), max_tokens=10)])
    tokens = probe.tokens[("a", 0)]
    eos = tokens[3]
    k = tokens.index(eos) + 1
    t, _, _ = run([req("a", range(10), max_tokens=10)], eos=[eos])
    assert t.tokens[("a", 0)] == tokens[:k] and t.finish_reasons[("a", 0)] == FinishReason.STOP
    t, _, _ = run([req("a", range(10), max_tokens=10, ignore_eos=True)], eos=[eos])
    assert t.tokens[("a", 0)] == tokens and t.finish_reasons[("a", 0)] == FinishReason.LENGTH
    t, _, _ = run([req("a", range(10), max_tokens=10, stop_token_ids=(eos,))])
    assert t.tokens[("a", 0)] == tokens[:k] and t.finish_reasons[("a", 0)] == FinishReason.STOP
    t, _, _ = run([req("a", range(10), max_tokens=100)], max_model_len=16)
    assert t.tokens[("a", 0)] == tokens[:6] and t.finish_reasons[("a", 0)] == FinishReason.LENGTH


def test_finished_requests_are_dropped_by_the_worker_on_the_next_step():
    s, r = setup()
    s.add_request(req("a", range(5), max_tokens=1))
    s.add_request(req("b", range(9), max_tokens=3))
    run_steps(s, r, until=lambda s: "a" not in s.requests)
    assert "a" in r.requests
    out = s.schedule()
    assert out.finished_request_ids == {"a"}
    r.execute(out)
    assert "a" not in r.requests


def test_logprobs_are_passed_through_where_asked():
    t, _, _ = run([req("a", range(5), max_tokens=2, logprobs=1), req("b", range(5), max_tokens=2)])
    outs = {o.request_id: o for o in t.outputs}
    assert outs["a"].new_logprobs[0].token_id == outs["a"].new_token_ids[0]
    assert outs["b"].new_logprobs is None


def test_invalid_requests_raise():
    s, _ = setup(max_model_len=16, max_num_seqs=4)
    with pytest.raises(ValueError):
        s.add_request(req("a", range(16)))
    with pytest.raises(ValueError):
        s.add_request(req("a", range(3), n=5))
    s.add_request(req("a", range(3)))
    with pytest.raises(ValueError):
        s.add_request(req("a", range(3)))
    s.add_request(req("p", range(3), n=2))
    with pytest.raises(ValueError):
        s.add_request(req("p-1", range(3)))  # reserved for p's second child
    with pytest.raises(ValueError):
        SchedulerConfig(block_size=4, num_blocks=4, max_model_len=16)  # 3 usable blocks < 4


def test_num_matched_tokens_and_load_for_the_router():
    s, r = setup()
    s.add_request(req("a", range(22), max_tokens=2))
    run_steps(s, r)
    assert s.num_matched_tokens(s.block_hasher.hash_tokens(list(range(30)))) == 20
    s.add_request(req("b", range(7)))
    load = s.load()
    assert (load.num_waiting_reqs, load.num_waiting_tokens, load.num_running_seqs) == (1, 7, 0)
    assert load.num_free_blocks == load.num_usable_blocks == 63
