"""Scheduler configuration: frozen, validated once, no environment reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # the token budget of one step, summed over requests
    max_num_seqs: int = 256  # sequences in the running batch at most (an unforked n>1 request counts n)
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 1024  # blocks in the worker's KV pool, including the null block 0
    max_model_len: int = 2048  # prompt + output tokens of one sequence at most
    enable_prefix_caching: bool = True  # reuse computed full blocks across requests
    enable_chunked_prefill: bool = True  # off: a waiting request's tokens must fit the budget whole
    long_prefill_token_threshold: int | None = None  # tokens one request may take per step; None: the budget
    # Prompt tokens one step may compute, summed over requests, while sequences decode (None: the
    # budget). Every prompt token in a step delays each decoding stream's next token, so this
    # bounds that delay per step (Sarathi-Serve's stall-free batching) instead of computing
    # waves of prompts in single long steps.
    max_prefill_tokens_while_decoding: int | None = None
    # ...and of long prompts (more than long_prefill_token_threshold tokens), summed over them:
    # the tokens such a step computes at most (None: no cap). Prompts up to the threshold are
    # computed whole, so a burst of short prompts still starts together, while long ones beside
    # decoding streams delay each of their tokens by one short chunk a step, not a threshold's.
    long_prefill_tokens_while_decoding: int | None = None
    # The engine decides step N+1 while the worker runs step N (Scheduler.schedule_ahead), so
    # the worker never waits for the scheduler between steps. Needs a worker that runs steps
    # in the order they were handed out (a Ray actor does, per caller; so do the engine's threads).
    async_scheduling: bool = False
    # Prefill batching while streams decode (TGI's waiting_served_ratio and max_waiting_tokens):
    # every step that computes a prompt stalls the decodes beside it, so while sequences run,
    # new requests wait until they are at least this share of the running sequences, or the
    # oldest has waited max_waiting_steps steps. Prompts that arrive close together then cost
    # running streams one stall, not one each. 0: admit at once (vLLM's rule).
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 20
    # ...and while at least half of the running sequences reach max_tokens within this many steps
    # (0: never), new requests wait for them to end, whatever their number: a prompt computed now
    # would stall streams that are about to finish anyway. Still at most max_waiting_steps.
    # Conversely, while at least half of them have sampled fewer than this many tokens, new
    # requests are not held: they join the batch just started and end within this many steps of it.
    hold_while_finishing_steps: int = 0
    # A waiting request whose next prompt blocks, this many tokens of them or more, are being
    # computed by a running request (scheduled, not yet cached) waits until they are cached,
    # keeping its place, instead of computing them too: a burst with one long system prompt
    # computes it once. Shorter shared runs (a chat template's opening) are computed twice
    # rather than cost the follower the step or two before the blocks are cached. None: never.
    min_shared_prefix_to_wait: int | None = None
    # LoRA adapters (scheduler/lora_slots.py): at most max_loras distinct adapters among the
    # running requests, so in any one step; at most max_cpu_loras loaded on the worker, the least
    # recently used unpinned one evicted for a new one. A request of a further adapter waits,
    # keeping its place; requests of adapters already running may pass it until it has waited
    # max_lora_wait_steps steps, then none does (no starvation), and no other new adapter ever does.
    max_loras: int = 4
    max_cpu_loras: int = 8
    max_lora_wait_steps: int = 32
    # The worker's model has recurrent layers (workers/recurrent.py): a prefix hit also needs a snapshot of
    # their states at its end, of which the worker keeps num_state_snapshots (scheduler/state_snapshots.py).
    recurrent_state: bool = False
    num_state_snapshots: int = 0

    def __post_init__(self) -> None:
        assert 1 <= self.max_loras <= self.max_cpu_loras, (self.max_loras, self.max_cpu_loras)
        assert self.max_lora_wait_steps >= 0, self.max_lora_wait_steps
        assert self.max_num_batched_tokens >= 1, self.max_num_batched_tokens
        assert self.max_num_seqs >= 1, self.max_num_seqs
        assert self.block_size >= 1, self.block_size
        assert self.max_model_len >= 2, self.max_model_len
        t = self.long_prefill_token_threshold
        assert t is None or t >= 1, t
        cap = self.max_prefill_tokens_while_decoding
        assert cap is None or cap >= 1, cap
        long_cap = self.long_prefill_tokens_while_decoding
        assert long_cap is None or long_cap >= 1, long_cap
        assert self.waiting_served_ratio >= 0, self.waiting_served_ratio
        assert self.max_waiting_steps >= 0, self.max_waiting_steps
        assert self.hold_while_finishing_steps >= 0, self.hold_while_finishing_steps
        assert self.min_shared_prefix_to_wait is None or self.min_shared_prefix_to_wait >= 1
        # A lone sequence of max_model_len tokens must fit the pool, or preemption could loop.
        if self.num_blocks - 1 < self.max_blocks_per_seq:
            raise ValueError(
                f"num_blocks={self.num_blocks} (1 is the null block) cannot hold one sequence of "
                f"max_model_len={self.max_model_len} tokens ({self.max_blocks_per_seq} blocks)"
            )
        # Without chunking, a preempted sequence is recomputed whole in one step.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)
