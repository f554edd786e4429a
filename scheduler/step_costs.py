"""What a worker's steps cost, measured when it starts, and the prompt-batching rules they imply.

A worker times a few steps of its own model before it serves (workers/step_costs.py) and
reports, per step:

    step_ms(decode_rows, prompt_tokens) = decode_step_ms + decode_rows x decode_row_ms
                                          + prompt_tokens x prompt_token_ms

The scheduler's rules for computing prompts beside decoding streams exist because a prompt
token stalls every running stream: a step that computes T prompt tokens delays each stream's
next token by T x prompt_token_ms. How long that is, counted in decode steps, decides them
(prefill_rules):

- waiting_served_ratio / hold_while_finishing_steps (TGI's rule: hold arrivals while streams
  decode, so that several prompts share one stall). Worth it where one typical prompt stalls
  the streams for many decode steps: there the three knobs keep the values they were tuned to
  (0.3, 4, 128). Where it stalls them for a few, holding only delays the new request's first
  token: the rules turn off (ratio 0, vLLM's rule), and
- long_prefill_tokens_while_decoding is the chunk a long prompt computes per step beside
  decoding streams: as many tokens as cost about one decode step (a stream's token gap at most
  doubles), in whole blocks, at least MIN_LONG_CHUNK.
- max_num_batched_tokens, the step budget. Where prompts are dear, 2048 (HELD_STEP_BUDGET): the
  prompts a hold gathers are computed together. Where they are cheap, 512 (CHEAP_STEP_BUDGET): a
  wave of arrivals is computed over a few shorter steps, so the first prompts answer sooner and
  the running streams get a token between them, at the same throughput.

A value set in the app's config (the YAML) wins over the derived one (serve_app/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# A typical prompt stalls streams for at most this many decode steps: arrivals are admitted at
# once. More: they are held (HOLD_RATIO, HOLD_FINISHING_STEPS), the rules tuned where a prompt
# cost many decode steps. Measured on a 2-core Xeon with AMX, SmolLM2 (workers/step_costs.py):
# 2.3-2.5 steps in bf16 and 3.2-3.9 for the GGUF on tiles, 7.6-10.0 with the tiles off (the
# AVX-512 vector kernels, the regime the holding rules were tuned in). Served there, bf16, c16
# (docs/serving.md): admitting at once gave TTFT p50 497-558 ms against holding's 587-606, at
# 479-485 tok/s against 486-494.
ADMIT_AT_ONCE_STALL_STEPS = 5.0
HOLD_RATIO = 0.3
HOLD_FINISHING_STEPS = 4
HELD_LONG_CHUNK = 128  # ...and long prompts' chunk beside decodes, as tuned with them
HELD_STEP_BUDGET = 2048  # ...and the step budget, measured best with them on Zen 3 and Zen 4
# Where prompts are admitted at once: the same Xeon, bf16, served c16 (64 x 256 in / 128 out, two
# runs each, one period): steps of 2048 / 1024 / 512 tokens gave TTFT p50 531-582 / 501-514 /
# 360-376 ms at 457 / 445-459 / 455 tok/s; 2 prompts of 2048 tokens among 32 short streams,
# 370-377 / 364 / 359-368 tok/s, TTFT p99 (the long prompts) 1421-1466 / 1485-1488 / 1534-1562 ms.
CHEAP_STEP_BUDGET = 512
TYPICAL_PROMPT_TOKENS = 256  # what "a typical prompt" costs is measured at this length
MIN_LONG_CHUNK = 64


@dataclass(frozen=True, slots=True)
class StepCosts:
    """A worker's step costs, from steps timed at its start (workers/step_costs.py)."""

    decode_step_ms: float  # a step's fixed part: one decoding sequence's step, less its row
    decode_row_ms: float  # each decoding sequence in a step
    prompt_token_ms: float  # each prompt token a step computes
    decode_rows: int  # the decode batch the row cost was measured at (the running batch it stands for)

    def step_ms(self, decode_rows: int, prompt_tokens: int) -> float:
        return self.decode_step_ms + decode_rows * self.decode_row_ms + prompt_tokens * self.prompt_token_ms

    def stall_steps(self, prompt_tokens: int = TYPICAL_PROMPT_TOKENS) -> float:
        """A prompt's delay to running streams, in steps of the measured decode batch."""
        return prompt_tokens * self.prompt_token_ms / self.step_ms(self.decode_rows, 0)


@dataclass(frozen=True, slots=True)
class PrefillRules:
    """The scheduler's prompt-batching knobs (scheduler/config.py), derived from step costs."""

    waiting_served_ratio: float
    hold_while_finishing_steps: int
    long_prefill_tokens_while_decoding: int
    max_num_batched_tokens: int


def prefill_rules(costs: StepCosts, block_size: int) -> PrefillRules:
    if costs.stall_steps() > ADMIT_AT_ONCE_STALL_STEPS:  # dear prompts: the rules as they were tuned
        return PrefillRules(HOLD_RATIO, HOLD_FINISHING_STEPS, HELD_LONG_CHUNK, HELD_STEP_BUDGET)
    one_step = costs.step_ms(costs.decode_rows, 0) / max(costs.prompt_token_ms, 1e-9)
    return PrefillRules(waiting_served_ratio=0.0, hold_while_finishing_steps=0,
                        long_prefill_tokens_while_decoding=max(MIN_LONG_CHUNK, int(one_step) // block_size * block_size),
                        max_num_batched_tokens=CHEAP_STEP_BUDGET)
