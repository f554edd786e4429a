"""AutoscalePolicy on a simulated clock: delays, hysteresis, victims, bounds, scale to zero."""

import math

import pytest

from scheduler.autoscale import AutoscaleConfig, AutoscalePolicy, ClusterLoad, ScaleDecision, WorkerLoad

T = 8192  # the default target_waiting_tokens_per_worker


def worker(worker_id, state="serving", running=0, waiting=0, tokens=0, kv=0.0, unique=0):
    return WorkerLoad(worker_id, state, running, waiting, tokens, kv, unique)


def cluster(*workers, parked=0, p90=None):
    return ClusterLoad(tuple(workers), parked, p90)


def policy(min_workers=1, max_workers=4, **kw):
    return AutoscalePolicy(AutoscaleConfig(min_workers, max_workers, **kw))


def run(p, load, start, end, every=1.0):
    """Decides at start, start + every, ... < end with the same load; returns [(now, decision)]."""
    out = []
    now = start
    while now < end:
        out.append((now, p.decide(now, load)))
        now += every
    return out


def busy(worker_id, state="serving"):
    """A worker well inside the band: not idle, nothing over target, nothing near it."""
    return worker(worker_id, state, running=2, kv=0.1)


# --- config ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(min_workers=3, max_workers=2), "min_workers \\(3\\) must not exceed max_workers \\(2\\)"),
    (dict(min_workers=0, max_workers=0), "max_workers must be at least 1"),
    (dict(min_workers=-1, max_workers=2), "min_workers must be at least 0"),
    (dict(min_workers=1, max_workers=2, scale_up_delay_s=-1.0), "scale_up_delay_s must be a non-negative"),
    (dict(min_workers=1, max_workers=2, scale_down_delay_s=math.nan), "scale_down_delay_s must be a non-negative"),
    (dict(min_workers=1, max_workers=2, scale_down_step_s=-5), "scale_down_step_s must be a non-negative"),
    (dict(min_workers=1, max_workers=2, target_kv_use=1.5), "target_kv_use must be in"),
    (dict(min_workers=1, max_workers=2, target_waiting_tokens_per_worker=0), "target_waiting_tokens_per_worker"),
    (dict(min_workers=1, max_workers=2, target_queue_time_s=0.0), "target_queue_time_s must be positive"),
    (dict(min_workers=1, max_workers=2, scale_down_fraction=1.0), "scale_down_fraction must be in"),
    (dict(min_workers=1, max_workers=2, max_running_per_worker=0), "max_running_per_worker must be at least 1"),
])
def test_config_is_validated_with_clear_messages(kw, message):
    with pytest.raises(ValueError, match=message):
        AutoscaleConfig(**kw)


def test_zero_delays_and_min_equal_max_are_valid():
    cfg = AutoscaleConfig(2, 2, scale_up_delay_s=0.0, scale_down_delay_s=0.0)
    assert (cfg.min_workers, cfg.max_workers) == (2, 2)


def test_an_unknown_worker_state_is_refused():
    with pytest.raises(ValueError, match="state must be one of"):
        worker(0, state="ready")


# --- up -------------------------------------------------------------------------------------
def test_queue_over_target_adds_workers_after_the_delay_not_before():
    p = policy()
    load = cluster(worker(0, running=8, waiting=10, tokens=20_000))  # 20k > 8192 on 1 serving
    decisions = run(p, load, 0.0, 30.0)
    assert all(d.desired == 1 and d.reason == "steady" for _, d in decisions), decisions[-1]
    d = p.decide(30.0, load)
    assert (d.desired, d.reason, d.retire) == (math.ceil(20_000 / T), "queue", None)  # 3, not just +1


def test_a_burst_shorter_than_the_delay_does_nothing_and_resets_the_timer():
    p = policy()
    over = cluster(worker(0, running=8, waiting=10, tokens=20_000))
    calm = cluster(worker(0, running=8, waiting=1, tokens=100, kv=0.5))
    for _, d in run(p, over, 0.0, 25.0) + run(p, calm, 25.0, 27.0) + run(p, over, 27.0, 56.0):
        assert d.desired == 1, d
    assert p.decide(57.0, over).desired == 3  # 30 s after the burst came back at 27


def test_kv_over_target_adds_at_least_one():
    p = policy(scale_up_delay_s=10.0)
    load = cluster(worker(0, running=30, kv=0.95), worker(1, running=30, kv=0.93))
    run(p, load, 0.0, 10.0)
    d = p.decide(10.0, load)
    assert (d.desired, d.reason) == (3, "kv")  # ceil(1.88 / 0.9) = 3


def test_latency_counts_only_while_requests_wait():
    p = policy(scale_up_delay_s=5.0)
    served = cluster(worker(0, running=3, kv=0.2), worker(1, running=3, kv=0.2), p90=6.0)
    assert all(d.reason == "steady" and d.desired == 2 for _, d in run(p, served, 0.0, 20.0))
    waiting = cluster(worker(0, running=3, waiting=2, tokens=600, kv=0.2), worker(1, running=3, kv=0.2), p90=3.0)
    run(p, waiting, 20.0, 25.0)
    d = p.decide(25.0, waiting)
    assert (d.desired, d.reason) == (3, "latency")  # ceil(2 * 3.0 / 2.0)


def test_the_most_demanding_signal_names_the_reason():
    p = policy(max_workers=8, scale_up_delay_s=0.0)
    load = cluster(worker(0, running=5, waiting=40, tokens=5 * T + 1, kv=0.95), p90=4.0)
    d = p.decide(0.0, load)
    assert (d.desired, d.reason) == (6, "queue")
    assert "prompt tokens waiting" in d.detail and "KV use" in d.detail and "queue time" in d.detail


def test_starting_workers_count_as_capacity_already_coming():
    p = policy(max_workers=6)
    load = cluster(worker(0, running=8, waiting=10, tokens=20_000))
    run(p, load, 0.0, 30.0)
    assert p.decide(30.0, load).desired == 3
    # the caller started two: the same load needs nothing more, however long it lasts
    coming = cluster(worker(0, running=8, waiting=10, tokens=20_000), worker(1, "starting"), worker(2, "starting"))
    for _, d in run(p, coming, 31.0, 120.0):
        assert (d.desired, d.reason, d.retire) == (3, "steady", None), d
    # ...unless the signal says more are needed beyond them (after its own delay)
    more = cluster(worker(0, running=8, waiting=30, tokens=40_000), worker(1, "starting"), worker(2, "starting"))
    assert p.decide(120.0, more).desired == 3
    d = p.decide(150.0, more)
    assert (d.desired, d.reason) == (5, "queue")


def test_an_addition_restarts_the_up_timer():
    p = policy(max_workers=8)
    one = cluster(worker(0, running=8, waiting=10, tokens=20_000))
    run(p, one, 0.0, 30.0)
    assert p.decide(30.0, one).desired == 3
    # the new workers serve at 40 and the queue grew: still no addition before 60
    three = cluster(*(worker(i, running=8, waiting=20, tokens=18_000) for i in range(3)))
    assert all(d.desired == 3 for _, d in run(p, three, 40.0, 60.0))
    assert p.decide(60.0, three).desired == math.ceil(54_000 / T)


def test_at_max_workers_an_over_target_signal_reads_max():
    p = policy(max_workers=2, scale_up_delay_s=0.0)
    load = cluster(*(worker(i, running=8, waiting=30, tokens=50_000) for i in range(2)))
    d = p.decide(0.0, load)
    assert (d.desired, d.reason, d.retire) == (2, "max", None)
    one = cluster(worker(0, running=8, waiting=30, tokens=50_000))
    d = policy(max_workers=2, scale_up_delay_s=0.0).decide(0.0, one)
    assert (d.desired, d.reason) == (2, "queue")  # needs 7: clamped to max, the reason stays the signal


# --- down -----------------------------------------------------------------------------------
def test_scale_down_after_the_delay_one_worker_at_a_time():
    p = policy(scale_down_delay_s=600.0, scale_down_step_s=60.0)
    three = cluster(busy(0), worker(1, running=1, kv=0.05), busy(2))
    assert all(d.desired == 3 and d.retire is None for _, d in run(p, three, 0.0, 600.0, every=10.0))
    d = p.decide(600.0, three)
    assert (d.desired, d.reason, d.retire) == (2, "idle", 1)  # the fewest requests
    # while it drains, nothing else goes
    draining = cluster(busy(0), worker(1, "draining", running=1, kv=0.05), busy(2))
    assert all(d.desired == 2 and d.retire is None for _, d in run(p, draining, 601.0, 700.0))
    two = cluster(busy(0), busy(2))
    d = p.decide(700.0, two)  # drained, more than scale_down_step_s after the last retirement
    assert (d.desired, d.reason, d.retire) == (1, "idle", 2)  # tie on requests and blocks: highest id
    assert p.decide(800.0, cluster(busy(0))).desired == 1  # never below min_workers


def test_the_next_retirement_waits_the_step():
    p = policy(scale_down_delay_s=100.0, scale_down_step_s=60.0)
    run(p, cluster(busy(0), busy(1), busy(2)), 0.0, 100.0)
    assert p.decide(100.0, cluster(busy(0), busy(1), busy(2))).retire == 2
    two = cluster(busy(0), busy(1))
    assert all(d.retire is None for _, d in run(p, two, 101.0, 160.0))
    assert p.decide(160.0, two).retire == 1


def test_hysteresis_between_the_band_and_the_target_keeps_the_count():
    p = policy(scale_down_delay_s=60.0)
    # 0.6 of the waiting target per worker: not over (no addition), not under half (no retirement)
    mid = cluster(*(worker(i, running=4, waiting=3, tokens=int(0.6 * T), kv=0.3) for i in range(3)))
    for _, d in run(p, mid, 0.0, 3600.0, every=5.0):
        assert (d.desired, d.reason, d.retire) == (3, "steady", None), d
    # kv in the band on its own also holds the count
    kv_mid = cluster(*(worker(i, running=4, kv=0.6) for i in range(3)))
    assert all(d.retire is None for _, d in run(p, kv_mid, 3600.0, 7200.0, every=5.0))


def test_a_break_in_the_quiet_restarts_the_down_timer():
    p = policy(scale_down_delay_s=600.0)
    quiet = cluster(busy(0), busy(1))
    loud = cluster(worker(0, running=8, waiting=8, tokens=10_000, kv=0.5), busy(1))  # over the band, under target
    run(p, quiet, 0.0, 500.0, every=10.0)
    assert p.decide(500.0, loud).retire is None
    assert all(d.retire is None for _, d in run(p, quiet, 510.0, 1110.0, every=10.0))
    assert p.decide(1110.0, quiet).retire == 1


def test_no_retirement_when_one_worker_fewer_would_be_over_target():
    # a wide band (0.9 of each target): 2 workers with 1.6 targets of waiting tokens in total are
    # under the band, but one worker would hold 1.6 targets
    p = policy(scale_down_delay_s=60.0, scale_down_fraction=0.9)
    load = cluster(worker(0, running=4, waiting=8, tokens=int(0.8 * T), kv=0.1),
                   worker(1, running=4, waiting=8, tokens=int(0.8 * T), kv=0.1))
    assert all(d.retire is None for _, d in run(p, load, 0.0, 1000.0, every=10.0))
    lighter = cluster(worker(0, running=4, waiting=4, tokens=int(0.4 * T), kv=0.1),
                      worker(1, running=4, waiting=4, tokens=int(0.4 * T), kv=0.1))
    run(p, lighter, 1000.0, 1060.0)
    assert p.decide(1060.0, lighter).retire is not None


def test_full_batches_with_little_kv_keep_their_workers_when_the_batch_size_is_known():
    # 4 workers, each with its 16 seats taken, no queue, a third of the KV used
    full = cluster(*(worker(i, running=16, kv=0.3) for i in range(4)))
    blind = policy(scale_down_delay_s=60.0)
    run(blind, full, 0.0, 60.0)
    assert blind.decide(60.0, full).retire is not None  # without the batch size it cannot tell
    p = policy(scale_down_delay_s=60.0, max_running_per_worker=16)
    assert all(d.retire is None for _, d in run(p, full, 0.0, 3600.0, every=10.0))
    # half the seats in use over 4 workers: the remaining 3 would hold them; still in the band
    half = cluster(*(worker(i, running=8, kv=0.2) for i in range(4)))
    run(p, half, 3600.0, 3660.0)
    assert p.decide(3660.0, half).retire is not None


def test_parked_requests_block_scale_down():
    p = policy(scale_down_delay_s=60.0)
    load = cluster(busy(0), busy(1), parked=1)
    assert all(d.retire is None for _, d in run(p, load, 0.0, 600.0, every=10.0))


# --- victims --------------------------------------------------------------------------------
@pytest.mark.parametrize("workers, expected", [
    # fewest running + waiting first
    ((worker(0, running=3), worker(1, running=1, waiting=1), worker(2, running=4)), 1),
    # then fewest unique cached blocks
    ((worker(0, running=1, unique=50), worker(1, running=1, unique=10), worker(2, running=1, unique=30)), 1),
    # then the highest id
    ((worker(0, running=1, unique=5), worker(3, running=1, unique=5), worker(1, running=1, unique=5)), 3),
    # a starting worker first: it holds nothing, and the serving ones keep serving while it would load
    ((worker(0, unique=0), worker(1, "starting")), 1),
    ((worker(4, "starting"), worker(2, "starting")), 4),
    # a draining worker is never chosen again
    ((worker(0, "draining"), worker(1, running=2), worker(2, running=5)), 1),
])
def test_victim_choice(workers, expected):
    p = policy(min_workers=0, max_workers=1)  # too many workers: the max clamp retires one now
    d = p.decide(0.0, cluster(*workers))
    assert (d.desired, d.reason, d.retire) == (1, "max", expected)


# --- bounds ---------------------------------------------------------------------------------
def test_below_min_at_start_asks_for_min_at_once():
    d = policy(min_workers=2, max_workers=4).decide(0.0, cluster())
    assert (d.desired, d.reason, d.retire) == (2, "min", None)
    d = policy(min_workers=2, max_workers=4).decide(0.0, cluster(worker(0, "starting")))
    assert (d.desired, d.reason) == (2, "min")
    # draining workers do not count toward min
    d = policy(min_workers=2, max_workers=4).decide(0.0, cluster(busy(0), busy(1, "draining")))
    assert (d.desired, d.reason) == (2, "min")


def test_above_max_retires_one_per_call():
    p = policy(min_workers=1, max_workers=2)
    d = p.decide(0.0, cluster(busy(0), busy(1), worker(2, running=1)))
    assert (d.desired, d.reason, d.retire) == (2, "max", 2)
    d = p.decide(1.0, cluster(busy(0), busy(1), worker(2, "draining", running=1)))
    assert (d.desired, d.reason, d.retire) == (2, "steady", None)


# --- scale to zero and wake -----------------------------------------------------------------
def test_an_idle_cluster_goes_to_zero_after_the_delay_and_wakes_at_once():
    p = policy(min_workers=0, max_workers=2, scale_down_delay_s=300.0)
    idle = cluster(worker(0))
    assert all(d.desired == 1 for _, d in run(p, idle, 0.0, 300.0, every=10.0))
    d = p.decide(300.0, idle)
    assert (d.desired, d.reason, d.retire) == (0, "idle", 0)
    assert p.decide(301.0, cluster(worker(0, "draining"))).desired == 0
    assert p.decide(302.0, cluster()) == ScaleDecision(0, "steady")
    d = p.decide(400.0, cluster(parked=3))
    assert (d.desired, d.reason) == (1, "wake")  # no delay
    d = p.decide(401.0, cluster(worker(0, "starting"), parked=3))
    assert (d.desired, d.reason) == (1, "steady")  # coming


def test_the_last_worker_stays_while_anything_runs_or_waits():
    p = policy(min_workers=0, max_workers=2, scale_down_delay_s=300.0)
    trickle = cluster(worker(0, running=1, kv=0.01))  # far under every target, but not idle
    assert all(d.desired == 1 for _, d in run(p, trickle, 0.0, 2000.0, every=10.0))
    run(p, cluster(worker(0)), 2000.0, 2200.0, every=10.0)
    assert p.decide(2200.0, cluster(worker(0, waiting=1, tokens=10))).desired == 1  # one request at 2200
    idle = cluster(worker(0))
    assert all(d.desired == 1 for _, d in run(p, idle, 2201.0, 2501.0, every=10.0))
    assert p.decide(2501.0, idle).desired == 0


def test_min_zero_with_two_workers_retires_down_to_one_before_idle():
    p = policy(min_workers=0, max_workers=2, scale_down_delay_s=100.0, scale_down_step_s=10.0)
    light = cluster(busy(0), worker(1))
    run(p, light, 0.0, 100.0)
    assert p.decide(100.0, light).retire == 1  # quiet, one fewer fits
    one = cluster(busy(0))
    assert all(d.desired == 1 for _, d in run(p, one, 101.0, 1000.0, every=10.0))  # busy: not idle
