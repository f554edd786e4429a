"""Building one step's SchedulerOutput, and the stop rules applied after it."""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass, field

from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class StepBatch:
    """What schedule() has decided so far in this step."""

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # request_id -> tokens
    scheduled: dict[str, Request] = field(default_factory=dict)  # request_id -> the request object
    copies: dict[str, tuple[int, int]] = field(default_factory=dict)  # child request_id -> (src, dst) block
    total_num_scheduled_tokens: int = 0  # sum of num_scheduled_tokens
    num_prompt_tokens: int = 0  # scheduled tokens at prompt positions
    lora_unloads: list[str] = field(default_factory=list)  # adapters the worker drops before the forward
    lora_loads: dict[str, str] = field(default_factory=dict)  # adapter name -> directory, loaded before the forward
    state_forks: list[tuple[str, str]] = field(default_factory=list)  # (parent, child): recurrent states copied
    state_saves: dict[str, tuple[int, int]] = field(default_factory=dict)  # request_id -> (position, snapshot slot)
    state_restores: dict[str, int] = field(default_factory=dict)  # request_id -> the snapshot its state starts from
    starts: dict[str, int] = field(default_factory=dict)  # request_id -> the position its tokens start at

    def add(
        self, request: Request, num_tokens: int, new_block_ids: list[int], block_table: Callable[[], list[int]],
        start: int | None = None,
    ) -> None:
        """Schedules `num_tokens` of `request` from position `start` (None: its computed
        tokens; more when a step still running computes some); `block_table()` gives its
        whole table (if new)."""
        rid = request.request_id
        start = request.num_computed_tokens if start is None else start
        assert num_tokens >= 1 and rid not in self.scheduled, rid
        if request.sent_to_worker:
            self.cached_requests.append(CachedRequestData(rid, new_block_ids, start))
        else:
            self.new_requests.append(
                NewRequestData(
                    request_id=rid,
                    prompt_token_ids=list(request.prompt_token_ids),  # the worker may own it
                    output_token_ids=request.output_token_ids[:],
                    sampling_params=request.sampling_params,
                    block_ids=block_table(),
                    num_computed_tokens=start,
                    lora_name=request.lora_name,
                    lora_path=request.lora_path,
                    state_snapshot=self.state_restores.get(rid),
                )
            )
            request.sent_to_worker = True
        self.num_scheduled_tokens[rid] = num_tokens
        self.scheduled[rid] = request
        self.starts[rid] = start
        self.total_num_scheduled_tokens += num_tokens
        num_prompt = len(request.prompt_token_ids)
        if start < num_prompt:
            self.num_prompt_tokens += min(start + num_tokens, num_prompt) - start

    def build(self, finished_request_ids: set[str]) -> SchedulerOutput:
        return SchedulerOutput(
            new_requests=self.new_requests,
            cached_requests=self.cached_requests,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=self.total_num_scheduled_tokens,
            finished_request_ids=finished_request_ids,
            copy_blocks=list(self.copies.values()),
            lora_unloads=self.lora_unloads,
            lora_loads=self.lora_loads,
            state_forks=self.state_forks,
            state_saves=self.state_saves,
        )


def check_stop(
    request: Request, token_id: int, eos_token_ids: Set[int], max_model_len: int
) -> RequestStatus | None:
    """The finished status after `token_id` was appended, or None to go on."""
    params = request.sampling_params
    if token_id in eos_token_ids and not params.ignore_eos:
        return RequestStatus.FINISHED_STOPPED
    if token_id in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
