"""Plain stats objects the core emits; the metrics module at the edge maps them to Prometheus."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class StepStats:
    """One engine step (schedule + execute + update) of one worker."""

    step: int = 0  # 1-based step number of this scheduler
    num_running_seqs: int = 0  # sequences in the running batch after scheduling
    num_waiting_reqs: int = 0  # requests queued after scheduling (preempted included)
    num_kv_blocks_used: int = 0  # blocks referenced by requests after scheduling
    num_kv_blocks_total: int = 0  # usable blocks of the pool (null block excluded)
    num_prefix_query_tokens: int = 0  # tokens looked up in the prefix cache on admission
    num_prefix_hit_tokens: int = 0  # of those, tokens found (block-rounded)
    num_preemptions: int = 0  # sequences preempted this step
    num_scheduled_tokens: int = 0  # tokens computed this step (the budget used)
    num_prompt_tokens_computed: int = 0  # scheduled tokens at prompt positions (recompute included)
    num_generation_tokens: int = 0  # tokens sampled this step
    num_new_reqs: int = 0  # requests sent to the worker as NewRequestData (forks included)
    num_finished_seqs: int = 0  # sequences finished by stop or length this step

    @property
    def kv_usage(self) -> float:
        """Fraction of usable blocks referenced, in [0, 1]."""
        return self.num_kv_blocks_used / max(1, self.num_kv_blocks_total)


_SUMMED = (
    "num_prefix_query_tokens",
    "num_prefix_hit_tokens",
    "num_preemptions",
    "num_scheduled_tokens",
    "num_prompt_tokens_computed",
    "num_generation_tokens",
    "num_new_reqs",
    "num_finished_seqs",
)


@dataclass(slots=True)
class CumulativeStats:
    """Counters since the scheduler was made (Prometheus counters map to these)."""

    num_steps: int = 0  # steps that scheduled at least one token
    num_prefix_query_tokens: int = 0  # tokens
    num_prefix_hit_tokens: int = 0  # tokens
    num_preemptions: int = 0  # sequences
    num_scheduled_tokens: int = 0  # tokens
    num_prompt_tokens_computed: int = 0  # tokens
    num_generation_tokens: int = 0  # tokens
    num_new_reqs: int = 0  # requests sent as new to the worker
    num_finished_seqs: int = 0  # sequences finished by stop or length
    num_aborted_seqs: int = 0  # sequences aborted
    num_migrated_reqs: int = 0  # requests taken away for migration

    def add(self, step: StepStats) -> None:
        self.num_steps += 1
        for name in _SUMMED:
            setattr(self, name, getattr(self, name) + getattr(step, name))

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(1, self.num_prefix_query_tokens)

    def copy(self) -> CumulativeStats:
        return dataclasses.replace(self)
