"""Prefix caching for recurrent layers (scheduler/state_snapshots.py): the scheduler saves a state
snapshot where a prompt's last full block ends, a hit is cut back to a prefix with one, and
FakeRunner's recurrent mode checks that every restored state is the request's own prefix."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.block_hash import BlockHash
from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineRequest
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.state_snapshots import StateSnapshots
from scheduler.testing import FakeRunner, run_to_end

CFG = SchedulerConfig(block_size=4, num_blocks=64, max_model_len=64, max_num_batched_tokens=8, max_num_seqs=8,
                      recurrent_state=True, num_state_snapshots=2)


def test_the_snapshots_are_an_exact_lru():
    snapshots = StateSnapshots(2)
    a, b, c = (BlockHash(bytes([i]) * 32) for i in range(3))
    assert (snapshots.reserve(a), snapshots.reserve(b)) == (0, 1)
    assert snapshots.reserve(a) is None  # kept already
    assert snapshots.lookup(a) == 0  # a is now the most recently used: b goes next
    assert snapshots.reserve(c) == 1 and snapshots.lookup(b) is None
    assert (snapshots.num_saves, snapshots.num_evictions) == (3, 1)
    assert StateSnapshots(0).reserve(a) is None


@pytest.mark.parametrize("ahead", [False, True])
def test_a_hit_restores_the_state_where_the_prompt_s_last_full_block_ends(ahead):
    scheduler = Scheduler(CFG, eos_token_ids=[])
    runner = FakeRunner(CFG.block_size, CFG.num_blocks, recurrent=True)
    prompt = list(range(100, 130))  # 30 tokens: the snapshot at 28 (7 blocks), the last before token 29
    hits = []
    for tokens, n in ((prompt, 1), (prompt, 1), (prompt + [7, 8, 9], 1), (prompt[:20] + [5, 6], 1), (prompt, 3)):
        request_id = f"r{len(hits)}"
        scheduler.add_request(EngineRequest(request_id, tokens, SamplingParams(temperature=0.0, max_tokens=3, n=n)))
        request = scheduler.requests[request_id]
        run_to_end(scheduler, runner, ahead)
        hits.append(request.num_cached_tokens)
    # the same prompt and one extending it hit 28; one sharing 5 blocks finds no state there, and keeps its own at
    # 20, evicting the least recently used of the two slots (28's: the one at 32 is newer); so the fork hits 20, and
    # keeps 28 again in place of 32
    assert hits == [0, 28, 28, 0, 20]
    assert runner.num_restores == 3 and sorted(position for position, _ in runner.snapshots.values()) == [20, 28]


def test_without_snapshots_a_recurrent_model_recomputes_the_prompt():
    scheduler = Scheduler(replace(CFG, num_state_snapshots=0), eos_token_ids=[])
    runner = FakeRunner(CFG.block_size, CFG.num_blocks, recurrent=True)
    for request_id in ("a", "b"):
        scheduler.add_request(EngineRequest(request_id, list(range(30)), SamplingParams(temperature=0.0, max_tokens=2)))
        request = scheduler.requests[request_id]
        run_to_end(scheduler, runner, False)
        assert request.num_cached_tokens == 0 and runner.num_restores == 0


def test_a_hit_without_its_state_is_caught_by_the_fake_worker(monkeypatch):
    """The check the property tests rely on: a hit whose snapshot is not restored fails the step."""
    monkeypatch.setattr(Scheduler, "_with_state_snapshot", lambda self, request, computed, batch: computed)
    scheduler = Scheduler(CFG, eos_token_ids=[])
    runner = FakeRunner(CFG.block_size, CFG.num_blocks, recurrent=True)
    scheduler.add_request(EngineRequest("a", list(range(30)), SamplingParams(temperature=0.0, max_tokens=2)))
    run_to_end(scheduler, runner, False)
    scheduler.add_request(EngineRequest("b", list(range(20)) + [1, 2], SamplingParams(temperature=0.0, max_tokens=2)))
    with pytest.raises(AssertionError, match="starts at 20 with a state of None"):
        run_to_end(scheduler, runner, False)
