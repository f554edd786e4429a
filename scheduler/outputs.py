"""The data objects that cross layer boundaries. Stdlib only.

Step contract (scheduler <-> worker), one round per engine step:

    scheduler_output = scheduler.schedule()
    runner_output    = runner.execute(scheduler_output)
    deltas           = scheduler.update_from_output(scheduler_output, runner_output)

Token layout of one request, as both sides see it:

    token_ids: [ prompt ............................ | output ........... ]
               0                 num_computed_tokens        num_tokens
                                 |<-- num_scheduled -->|
                                 (computed this step)

- The worker computes KV (and logits where needed) for positions
  [num_computed_tokens, num_computed_tokens + num_scheduled).
- When num_computed_tokens + num_scheduled == num_tokens (every known token is now
  computed), the worker samples one token from the last position and appends it to its
  own copy of token_ids. Otherwise (a prefill chunk) it samples nothing.
- A request is sent in full once (NewRequestData), then only what changed
  (CachedRequestData). Preempted, finished, aborted and forked-away requests are listed in
  finished_request_ids so the worker drops their state; a preempted request comes back
  later as NewRequestData with its generated tokens in output_token_ids.
- Block b of a request holds positions [b * block_size, (b + 1) * block_size).
- n>1 forking: the parent is computed up to num_tokens - 1 (its last prompt token is never
  scheduled, so it never samples). Then it is replaced by n children that share its full
  blocks by reference; each child gets a private copy of the last partial block
  (copy_blocks, done by the worker before the forward) and computes the last prompt
  token itself, so each samples with its own seed.

Sampling determinism: a seeded request's token at output position p (0-based) is drawn
with a generator seeded from (seed, p) alone. So preemption, batching and migration to
another worker never change a seeded request's output.

Logprobs are log_softmax of the raw model logits (before penalties and temperature).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from scheduler.sampling_params import SamplingParams


class WorkerStateLostError(KeyError):
    """The worker does not hold state the step relies on: it restarted (empty KV pool and
    request states) since the scheduler last saw it. The scheduler treats it as the death
    of the worker it knew: the requests are recomputed (scheduler/engine_group.py)."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or a stop string seen by the ingress
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client gone, timeout, or shutdown


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability under the raw model logits
    top: list[tuple[int, float]]  # the top-k (token_id, logprob), most likely first


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before (resumed after preemption/migration)
    sampling_params: SamplingParams
    block_ids: list[int]  # the request's whole block table so far
    num_computed_tokens: int  # tokens whose KV is already in the pool (prefix hit / fork)
    lora_name: str | None = None  # the LoRA adapter to apply (loaded on the worker); None: the base model
    lora_path: str | None = None  # where it is, should the worker not hold it (None: the worker's start-time list)
    # recurrent layers: the prefix-cache snapshot its state starts from (a hit of num_computed_tokens; the
    # scheduler's scheduler/state_snapshots.py); None: from zero, or from its fork (SchedulerOutput.state_forks)
    state_snapshot: int | None = None


@dataclass(slots=True)
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]  # blocks appended to the request's table this step
    num_computed_tokens: int  # authoritative progress before this step's tokens


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens computed this step
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens
    finished_request_ids: set[str] = field(default_factory=set)  # drop worker state
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies before the forward
    # LoRA adapters (scheduler/lora_slots.py), applied before the forward, unloads first:
    lora_unloads: list[str] = field(default_factory=list)  # adapter names the worker drops
    lora_loads: dict[str, str] = field(default_factory=dict)  # adapter name -> its directory, to load
    # recurrent layers (workers/recurrent.py), before the finished are dropped: (parent, child) of each n>1 fork
    # this step, the child's state a copy of the parent's; and request id -> (position, snapshot): keep its state
    # after that many tokens as that prefix-cache snapshot (scheduler/state_snapshots.py)
    state_forks: list[tuple[str, str]] = field(default_factory=list)
    state_saves: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]  # request_id -> token sampled this step
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # request_id -> logprobs, only where asked


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the ingress submits: token ids only, no text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0  # seconds, from the engine's clock (time.monotonic by default)
    # Tokens this request already generated and streamed (a resubmission after a scheduler
    # restart, n=1 only): they are outputs, not prompt, so they count toward max_tokens,
    # penalties see them as generated, and seeded sampling keeps each token's output position.
    output_token_ids: tuple[int, ...] = ()
    lora_name: str | None = None  # a LoRA adapter the workers serve (by its served name); None: the base model
    lora_path: str | None = None  # its directory; None: resolved by the engine group's adapter registry


@dataclass(slots=True)
class RequestOutput:
    """One delta of one sequence: the tokens produced since the last delta."""

    request_id: str  # the client's request id (the parent's for n>1)
    index: int  # sequence index within n, 0..n-1
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # aligned with new_token_ids, where asked
    finish_reason: FinishReason | None  # set on the last delta of the sequence
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (block-rounded)
    worker: str | None = None  # label of the worker whose engine produced the delta (None: unnamed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
