"""bench/sim.py: the c16 closed loop in virtual time, with the real scheduler."""

from __future__ import annotations

from bench import sim


def test_a_late_burst_member_stays_with_its_wave():
    """Seed 0 with a 0.1 s first-wave tail: three of the first sixteen requests reach the
    scheduler after the burst's prompts were decided. Before _running_mostly_starting they were
    held 20 steps, ran 20 steps behind their wave, and their clients' next requests stalled the
    next wave at its 40th token (ITL p99 468 ms virtual, 108 gaps over 150 ms)."""
    workload = sim.Workload(first_wave_mean_s=0.1)
    shipped = sim.simulate(sim.SHIPPED, workload, sim.StepCost(), seed=0)
    assert shipped.itl_p99_ms < 100
    assert all("long gaps at [" in line for line in shipped.timeline) and len(shipped.timeline) == 64
    later = [line for line in shipped.timeline if " sent   0.00" not in line]
    assert not any(int(position) > 10 for line in later  # no gap beyond a wave's first tokens
                   for position in line.split("long gaps at [")[1].rstrip("]").split(", ") if position)

