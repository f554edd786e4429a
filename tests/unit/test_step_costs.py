"""The prompt-batching rules a worker's measured step costs imply (scheduler/step_costs.py), and
the app config's precedence over them (serve_app/config.py)."""

from __future__ import annotations

from scheduler.step_costs import (ADMIT_AT_ONCE_STALL_STEPS, CHEAP_STEP_BUDGET, HELD_LONG_CHUNK, HELD_STEP_BUDGET,
                                  HOLD_FINISHING_STEPS, HOLD_RATIO, MIN_LONG_CHUNK, TYPICAL_PROMPT_TOKENS, StepCosts,
                                  prefill_rules)
from serve_app.config import AppArgs

SIZES = dict(block_size=16, num_blocks=600, max_model_len=8192)


def costs_with_stall(stall_steps: float, decode_ms: float = 20.0) -> StepCosts:
    """Costs whose typical prompt stalls 16 decoding streams for stall_steps of their steps."""
    return StepCosts(decode_step_ms=decode_ms - 16 * 0.5, decode_row_ms=0.5,
                     prompt_token_ms=stall_steps * decode_ms / TYPICAL_PROMPT_TOKENS, decode_rows=16)


def test_the_step_model_adds_its_parts():
    costs = StepCosts(decode_step_ms=5.0, decode_row_ms=0.5, prompt_token_ms=0.25, decode_rows=16)
    assert costs.step_ms(16, 0) == 13.0 and costs.step_ms(2, 100) == 31.0
    assert costs.stall_steps(256) == 64.0 / 13.0


def test_cheap_prompts_are_admitted_at_once_and_dear_ones_held():
    cheap = prefill_rules(costs_with_stall(ADMIT_AT_ONCE_STALL_STEPS * 0.9), block_size=16)
    assert (cheap.waiting_served_ratio, cheap.hold_while_finishing_steps) == (0.0, 0)
    dear = prefill_rules(costs_with_stall(ADMIT_AT_ONCE_STALL_STEPS * 1.1), block_size=16)
    assert (dear.waiting_served_ratio, dear.hold_while_finishing_steps) == (HOLD_RATIO, HOLD_FINISHING_STEPS)
    assert dear.long_prefill_tokens_while_decoding == HELD_LONG_CHUNK  # the tuned rules, whole
    # cheap prompts come in shorter steps; dear ones keep the budget tuned with holding
    assert (cheap.max_num_batched_tokens, dear.max_num_batched_tokens) == (CHEAP_STEP_BUDGET, HELD_STEP_BUDGET)
    assert CHEAP_STEP_BUDGET < HELD_STEP_BUDGET


def test_a_long_prompts_chunk_costs_about_one_decode_step_in_whole_blocks():
    rules = prefill_rules(StepCosts(10.0, 0.625, 0.05, 16), block_size=16)  # a 20 ms step: 400 tokens
    assert rules.long_prefill_tokens_while_decoding == 400
    assert prefill_rules(StepCosts(10.0, 0.625, 0.05, 16), block_size=32).long_prefill_tokens_while_decoding == 384
    near = prefill_rules(StepCosts(10.0, 0.625, 0.357, 16), block_size=16)  # cheap enough, 56 tokens a step: the floor
    assert near.waiting_served_ratio == 0.0 and near.long_prefill_tokens_while_decoding == MIN_LONG_CHUNK


def test_the_config_wins_over_the_costs_and_the_costs_over_the_defaults():
    cheap = costs_with_stall(1.0)
    derived = prefill_rules(cheap, 16)
    config = AppArgs().scheduler_config(**SIZES, step_costs=cheap)
    assert config.waiting_served_ratio == derived.waiting_served_ratio == 0.0
    assert config.long_prefill_tokens_while_decoding == derived.long_prefill_tokens_while_decoding
    pinned = AppArgs.model_validate({"waiting_served_ratio": 0.5, "long_prefill_tokens_while_decoding": None})
    config = pinned.scheduler_config(**SIZES, step_costs=cheap)
    assert (config.waiting_served_ratio, config.long_prefill_tokens_while_decoding) == (0.5, None)
    assert config.hold_while_finishing_steps == derived.hold_while_finishing_steps
    sources = pinned.prefill_rule_sources(cheap, 16)
    assert sources["waiting_served_ratio"] == (0.5, "config")
    assert sources["hold_while_finishing_steps"] == (0, "step costs")
    assert AppArgs().scheduler_config(**SIZES, step_costs=cheap).max_num_batched_tokens == CHEAP_STEP_BUDGET
    budget = AppArgs.model_validate({"max_num_batched_tokens": 4096})
    assert budget.scheduler_config(**SIZES, step_costs=cheap).max_num_batched_tokens == 4096
    assert budget.prefill_rule_sources(cheap, 16)["max_num_batched_tokens"] == (4096, "config")
    defaults = AppArgs().scheduler_config(**SIZES)  # no costs measured: the fields' defaults
    assert (defaults.waiting_served_ratio, defaults.hold_while_finishing_steps) == (0.3, 4)
    assert defaults.max_num_batched_tokens == 2048
    assert AppArgs().prefill_rule_sources(None, 16)["waiting_served_ratio"] == (0.3, "default")
