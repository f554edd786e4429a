"""Prompt tokens per step while sequences decode (SchedulerConfig.max_prefill_tokens_while_decoding).

Every prompt token computed in a step delays the next token of each stream decoding in it. The
cap bounds that delay per step: a prompt that arrives beside running streams is spread over
several steps of at most the cap, and the streams decode in every one of them.
"""

import pytest

from scheduler.testing import AheadDriver, assert_pool_full, run_steps
from tests.unit.test_scheduler_hold import arrivals_transcript, make, prompt_steps, req, start_four_decoding, step


def test_without_decodes_a_step_takes_the_whole_budget():
    s, runner = make(max_prefill_tokens_while_decoding=6)
    for i in range(4):
        s.add_request(req(f"new{i}", 8, max_tokens=2))
    assert sum(step(s, runner).num_scheduled_tokens.values()) == 32  # nothing decodes yet: no cap
    run_steps(s, runner)
    assert_pool_full(s)


def test_beside_decodes_prompts_take_at_most_the_cap_and_the_streams_decode_every_step():
    s, runner = make(max_prefill_tokens_while_decoding=6)
    start_four_decoding(s, runner)
    s.add_request(req("new0", 20, max_tokens=2))
    s.add_request(req("new1", 5, max_tokens=2))
    steps = [step(s, runner).num_scheduled_tokens for _ in range(6)]
    for scheduled in steps:
        assert all(scheduled[f"run{i}"] == 1 for i in range(4))  # every stream, every step
        assert scheduled.get("new0", 0) + scheduled.get("new1", 0) <= 6
    # first come, first served: new0's 20 tokens in chunks of 6, then new1 with what is left
    assert [scheduled.get("new0", 0) for scheduled in steps[:4]] == [6, 6, 6, 2]
    assert steps[3].get("new1", 0) == 4
    run_steps(s, runner)
    assert_pool_full(s)


def test_no_cap_while_as_many_prompts_wait_as_streams_decode():
    """Half of a wave decoding beside the other half's prompts: finishing those prompts soon
    is worth one long step of the few streams."""
    s, runner = make(max_prefill_tokens_while_decoding=6)
    start_four_decoding(s, runner)
    for i in range(4):
        s.add_request(req(f"new{i}", 8, max_tokens=2))
    scheduled = step(s, runner).num_scheduled_tokens
    assert [scheduled[f"new{i}"] for i in range(4)] == [8, 8, 8, 8]  # 4 prompts, 4 streams: no cap
    s.add_request(req("late", 8, max_tokens=2))
    assert step(s, runner).num_scheduled_tokens["late"] == 6  # 8 streams, 1 prompt: capped
    run_steps(s, runner)
    assert_pool_full(s)


def test_the_cap_counts_chunks_of_running_prompts_too():
    s, runner = make(max_prefill_tokens_while_decoding=10, long_prefill_token_threshold=8)
    start_four_decoding(s, runner)
    s.add_request(req("new0", 20, max_tokens=2))
    s.add_request(req("new1", 20, max_tokens=2))
    first = step(s, runner).num_scheduled_tokens
    assert (first["new0"], first["new1"]) == (8, 2)  # the per-request threshold, then the cap
    second = step(s, runner).num_scheduled_tokens
    assert (second["new0"], second["new1"]) == (8, 2)  # both run now; the older draws on the cap first
    run_steps(s, runner)
    assert_pool_full(s)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_the_cap_changes_when_tokens_come_never_which(ahead):
    capped, capped_runner = arrivals_transcript(ahead, 5, max_prefill_tokens_while_decoding=8)
    free, free_runner = arrivals_transcript(ahead, 5)
    assert capped.tokens == free.tokens and capped.finish_reasons == free.finish_reasons
    assert len(prompt_steps(capped_runner, "r")) > len(prompt_steps(free_runner, "r"))  # spread over more steps


def test_deciding_ahead_counts_the_streams_whose_prompt_the_running_step_finishes():
    """With async scheduling, step N+1 is decided before N's tokens exist: a sequence whose
    prompt N finishes decodes in N+1 and must count as decoding there."""
    s, runner = make(max_prefill_tokens_while_decoding=6, max_num_batched_tokens=32)
    driver = AheadDriver(s, runner)
    for i in range(4):
        s.add_request(req(f"run{i}", 8, max_tokens=40))
    s.add_request(req("new0", 20, max_tokens=2))  # the four prompts take the whole budget: it waits
    for _ in range(6):
        driver.step()  # the first decides the second (the four's first decodes, new0's start) ahead
    after_prompts = runner.scheduled_history[1:]
    assert all(scheduled.get("new0", 0) <= 6 for scheduled in after_prompts)
    assert sum(scheduled.get("new0", 0) for scheduled in after_prompts) >= 20  # its prompt, then decodes
    assert all(all(scheduled[f"run{i}"] == 1 for i in range(4)) for scheduled in after_prompts)
    while driver.busy:
        driver.step()
    assert_pool_full(s)


def test_beside_decodes_a_long_prompt_takes_short_chunks_and_a_short_one_goes_whole():
    """long_prefill_tokens_while_decoding: a prompt longer than long_prefill_token_threshold is
    computed in chunks of at most this many tokens while streams decode beside it; a prompt up
    to the threshold still goes in one step, and with nobody decoding the long one takes the
    threshold."""
    s, runner = make(long_prefill_token_threshold=12, long_prefill_tokens_while_decoding=4)
    s.add_request(req("alone", 30, max_tokens=2))
    assert step(s, runner).num_scheduled_tokens == {"alone": 12}  # nobody decodes: the threshold
    run_steps(s, runner)
    start_four_decoding(s, runner)
    s.add_request(req("long", 30, max_tokens=2))
    s.add_request(req("short", 12, max_tokens=2))
    steps = [step(s, runner).num_scheduled_tokens for _ in range(8)]
    assert all(all(scheduled[f"run{i}"] == 1 for i in range(4)) for scheduled in steps)
    assert [scheduled.get("long", 0) for scheduled in steps] == [4, 4, 4, 4, 4, 4, 4, 2]
    assert steps[0]["short"] == 12  # up to the threshold: whole, in the first step
    run_steps(s, runner)
    assert_pool_full(s)


def test_long_prompts_beside_decodes_share_one_chunk_a_step():
    s, runner = make(long_prefill_token_threshold=12, long_prefill_tokens_while_decoding=4)
    start_four_decoding(s, runner)
    s.add_request(req("long0", 14, max_tokens=2))
    s.add_request(req("long1", 14, max_tokens=2))
    steps = [step(s, runner).num_scheduled_tokens for _ in range(8)]
    assert [scheduled.get("long0", 0) for scheduled in steps] == [4, 4, 4, 2, 1, 0, 0, 0]  # then it decodes
    assert [scheduled.get("long1", 0) for scheduled in steps] == [0, 0, 0, 2, 4, 4, 4, 1]  # what long0 leaves
    run_steps(s, runner)
    assert_pool_full(s)


def test_a_stream_past_the_threshold_decodes_every_step_beside_a_long_prompt():
    """A decode is never a long prompt's chunk, whatever its sequence's length."""
    s, runner = make(long_prefill_token_threshold=12, long_prefill_tokens_while_decoding=4)
    start_four_decoding(s, runner)
    s.add_request(req("long", 40, max_tokens=2))
    step(s, runner)  # long's first chunk
    s.add_request(req("ctx", 11, max_tokens=8))  # whole in one step, then past 12 tokens as it decodes
    steps = [step(s, runner).num_scheduled_tokens for _ in range(7)]
    assert [scheduled["ctx"] for scheduled in steps] == [11, 1, 1, 1, 1, 1, 1]
    assert all(scheduled["long"] == 4 for scheduled in steps)  # it came first: it takes the chunk
    run_steps(s, runner)
    assert_pool_full(s)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "async"])
def test_the_long_prompt_chunk_changes_when_tokens_come_never_which(ahead):
    capped, capped_runner = arrivals_transcript(ahead, 5, long_prefill_token_threshold=10,
                                                long_prefill_tokens_while_decoding=3)
    free, free_runner = arrivals_transcript(ahead, 5, long_prefill_token_threshold=10)
    assert capped.tokens == free.tokens and capped.finish_reasons == free.finish_reasons
    assert capped_runner.scheduled_history != free_runner.scheduled_history
