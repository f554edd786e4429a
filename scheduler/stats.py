"""Plain stats objects the core emits; the metrics module at the edge maps them to Prometheus.

- StepStats: one engine step of one worker (Scheduler.schedule + update_from_output).
- CumulativeStats: the sums of StepStats since the scheduler was made.
- RequestStats: one client request, from arrival to its last final delta (the Engine's
  RequestStream times; engine clock, seconds).
- StatsSink: what an Engine reports to, if given one (scheduler/metrics.py's EngineMetrics).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol


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
    num_scheduled_seqs: int = 0  # sequences given tokens this step (the batch size)

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


@dataclass(slots=True)
class RequestStats:
    """One client request the engine finished (every sequence has its final delta)."""

    request_id: str  # the client's request id
    worker: str | None  # label of the engine's worker that finished it (None in-process)
    finish_reasons: list[str] = field(default_factory=list)  # per sequence, in finishing order: stop|length|abort|error
    num_prompt_tokens: int = 0  # tokens
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (block-rounded)
    num_generation_tokens: int = 0  # tokens streamed, every sequence
    num_seqs: int = 1  # n
    arrival_time: float = 0.0  # seconds, engine clock
    scheduled_time: float | None = None  # first scheduled for compute; None: never (aborted in queue)
    first_token_time: float | None = None  # first delta with tokens; None: no token
    finish_time: float = 0.0  # the last final delta

    @property
    def finish_reason(self) -> str:
        """The request's reason: its sequences' common reason, or "mixed" (n>1 only)."""
        reasons = set(self.finish_reasons)
        return reasons.pop() if len(reasons) == 1 else ("mixed" if reasons else "abort")

    @property
    def queue_time_s(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def time_per_output_token_s(self) -> float | None:
        """Decode time per token after the first, averaged over the sequences; None below 2 tokens."""
        num_after_first = self.num_generation_tokens / max(1, self.num_seqs) - 1
        if self.first_token_time is None or num_after_first < 1:
            return None
        return (self.finish_time - self.first_token_time) / num_after_first


class StatsSink(Protocol):
    """Where an Engine reports; called on the engine's event loop, must not block."""

    def on_step(self, worker: str | None, step: StepStats, duration_s: float,
                inter_token_latencies_s: list[float]) -> None:
        """One step: its stats, schedule-to-update wall time, and one latency per token that
        followed an earlier token of its sequence (gap since that token)."""

    def on_request_finished(self, request: RequestStats) -> None: ...
