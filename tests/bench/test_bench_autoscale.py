"""bench/bench_autoscale.py: short simulated runs complete every request, scale up then down, drain,
move what a drain leaves, scale to zero and wake; the policy's decisions are recorded."""

from __future__ import annotations

import dataclasses

from bench import bench_autoscale as ba
from scheduler.autoscale import AutoscaleConfig
from scheduler.config import SchedulerConfig

WORKER = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=2, block_size=16, num_blocks=160,
                         max_model_len=1024)
SMALL = ba.Setup(
    phases=(ba.Phase(10.0, 1), ba.Phase(60.0, 8), ba.Phase(60.0, 1)),
    prompt_tokens=256, output_tokens=32, worker=WORKER, startup_s=5.0, queue_window_s=5.0,
    step_time=dataclasses.replace(ba.GPU_STEP, base_s=0.05),  # fewer steps per virtual second: a quicker test
)
POLICY = AutoscaleConfig(1, 4, scale_up_delay_s=3.0, scale_down_delay_s=10.0, scale_down_step_s=5.0,
                         target_waiting_tokens_per_worker=512, max_running_per_worker=WORKER.max_num_seqs)


def assert_every_request_completed(run: ba.RunResult) -> None:
    assert run.records
    for rid, record in run.records.items():
        assert record.finished_at is not None, rid
        assert record.num_tokens == record.max_tokens, (rid, record.num_tokens, record.max_tokens)
        assert record.first_token_at is not None and record.sent_at <= record.first_token_at <= record.finished_at


def live_workers(run: ba.RunResult) -> list[int]:
    return [p.starting + p.serving + p.draining for p in run.timeline]


def test_a_short_stepped_run_scales_up_then_down_and_completes_every_request():
    run = ba.simulate(SMALL, "autoscale", POLICY)
    assert_every_request_completed(run)
    live = live_workers(run)
    top = live.index(max(live))
    assert live[0] == 1 and max(live) > 1 and live[-1] == 1 and top < len(live) - 1
    reasons = [d.reason for _, d in run.decisions]
    ups = [i for i, (_, d) in enumerate(run.decisions) if d.retire is None]
    downs = [i for i, (_, d) in enumerate(run.decisions) if d.retire is not None]
    assert ups and downs and max(ups) < min(downs), reasons  # up during the peak, down after it
    assert {run.decisions[i][1].reason for i in ups} <= {"queue", "kv", "latency"}
    assert {run.decisions[i][1].reason for i in downs} == {"idle"}
    # each decision acted on shows as events: the workers it added, the victim it named
    for i in ups:
        t, decision = run.decisions[i]
        before = [p for p in run.timeline if p.t < t][-1]
        started = [e for e in run.events if e[1] == "start" and e[0] == t]
        assert len(started) == decision.desired - (before.starting + before.serving)
        assert {e[3] for e in started} == {decision.reason}
    retires = [e for e in run.events if e[1] == "retire"]
    assert [e[2] for e in retires] == [run.decisions[i][1].retire for i in downs]
    assert {e[2] for e in run.events if e[1] == "gone"} == {e[2] for e in retires}
    # the peak's requests were sent in the peak window
    lo, hi = run.peak_window
    assert (lo, hi) == (10.0, 70.0) and run.ttfts(run.peak_window)


def test_fixed_runs_never_scale_and_the_comparison_has_three_runs():
    runs = ba.compare(SMALL, POLICY)
    assert [r.name for r in runs] == ["fixed 1", "fixed 4", "autoscale 1-4"]
    for run, count in zip(runs[:2], (1, 4)):
        assert_every_request_completed(run)
        assert not run.decisions and set(live_workers(run)) == {count}
    text = ba.table(runs)
    assert text.count("\n") == 4 and "autoscale 1-4" in text
    assert "worker-seconds" in ba.verdict(runs[1], runs[2])


def test_a_drain_that_times_out_moves_the_rest_and_the_streams_complete():
    # 8 streams, then 2 streams of long outputs: once 2 workers serve one stream each, the
    # victim has a running request, which the 0.5 s drain cannot finish
    setup = dataclasses.replace(SMALL, phases=(ba.Phase(5.0, 1), ba.Phase(30.0, 8), ba.Phase(90.0, 2)),
                                output_tokens=200, drain_timeout_s=0.5,
                                worker=dataclasses.replace(WORKER, num_blocks=320, max_model_len=2048))
    run = ba.simulate(setup, "autoscale", POLICY)
    assert_every_request_completed(run)
    moved = [r for r in run.records.values() if r.num_moves]
    assert moved, "no request was moved off a draining worker"
    assert live_workers(run)[-1] == 1
    gone = [e[2] for e in run.events if e[1] == "gone"]
    assert sorted(gone) == sorted(set(gone)) == sorted(e[2] for e in run.events if e[1] == "retire")


def test_scale_to_zero_parks_wakes_and_goes_back_to_zero():
    setup = dataclasses.replace(SMALL, phases=(ba.Phase(5.0, 0), ba.Phase(20.0, 2), ba.Phase(40.0, 0)))
    policy = dataclasses.replace(POLICY, min_workers=0)
    run = ba.simulate(setup, "autoscale", policy)
    assert_every_request_completed(run)
    reasons = [d.reason for _, d in run.decisions]
    assert reasons[0] == "wake" and reasons[-1] == "idle", reasons
    live = live_workers(run)
    assert live[0] == 0 and max(live) >= 1 and live[-1] == 0
    first = min(run.records.values(), key=lambda r: r.sent_at)
    assert first.first_token_at - first.sent_at >= setup.startup_s  # parked while the worker started
