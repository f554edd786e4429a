"""SimpleDriver: a minimal stand-in for the scheduler, for offline generation, tests and benchmarks.

It speaks the real step contract (SchedulerOutput in, ModelRunnerOutput out) but schedules
naively: first come first served, decodes before prefills, one token budget per step, an
optional prefill chunk size, blocks from a plain free list with reference counts, and no
preemption (running out of blocks is an error). The product scheduler lives in scheduler/.

Tests use its two extra knobs: a request can start with KV already in the pool
(prefix_block_ids + num_computed_tokens, optionally copy_blocks for a partial block), and a
request can keep its blocks after it finishes (keep_blocks) so another can reuse them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from scheduler.outputs import (
    CachedRequestData,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from scheduler.sampling_params import SamplingParams


@dataclass(slots=True)
class DriverRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    keep_blocks: bool  # leave the blocks allocated (and their KV intact) after finishing
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    sent: bool = False  # NewRequestData already sent to the runner
    unsent_block_ids: list[int] = field(default_factory=list)  # allocated since the last step
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)  # sent with the first step
    finish_reason: FinishReason | None = None
    lora_name: str | None = None  # the LoRA adapter the runner applies (loaded there); None: the base model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutOfBlocksError(RuntimeError):
    pass


class SimpleDriver:
    def __init__(self, runner, *, token_budget: int = 2048, prefill_chunk_size: int | None = None,
                 eos_token_ids: Iterable[int] | None = None):
        info = runner.model_info
        self.runner = runner
        self.block_size = info.block_size
        self.max_model_len = info.max_model_len
        self.token_budget = token_budget
        self.prefill_chunk_size = prefill_chunk_size
        self.eos_token_ids = set(info.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.free_block_ids = list(range(info.num_blocks - 1, 0, -1))  # block 0 is the null block
        self.block_refs: dict[int, int] = {}
        self.requests: dict[str, DriverRequest] = {}
        self.finished_since_last_step: set[str] = set()
        self.last_output: SchedulerOutput | None = None  # the SchedulerOutput of the last step

    def allocate_blocks(self, count: int) -> list[int]:
        if count > len(self.free_block_ids):
            raise OutOfBlocksError(f"need {count} KV blocks, {len(self.free_block_ids)} free (no preemption here)")
        blocks = [self.free_block_ids.pop() for _ in range(count)]
        for block in blocks:
            self.block_refs[block] = 1
        return blocks

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        for block in block_ids:
            self.block_refs[block] -= 1
            if self.block_refs[block] == 0:
                del self.block_refs[block]
                self.free_block_ids.append(block)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    *, prefix_block_ids: Sequence[int] = (), num_computed_tokens: int = 0,
                    copy_blocks: Sequence[tuple[int, int]] = (), keep_blocks: bool = False,
                    output_token_ids: Sequence[int] = (), lora_name: str | None = None) -> DriverRequest:
        """Queue a request. prefix_block_ids are shared blocks already holding its first
        num_computed_tokens tokens (copy_blocks fill private ones before its first forward).
        output_token_ids: tokens generated before a preemption; they count toward max_tokens."""
        params = params or SamplingParams()
        assert params.n == 1, "SimpleDriver does not fork (n > 1)"
        assert request_id not in self.requests, request_id
        assert num_computed_tokens < len(prompt_token_ids) + len(output_token_ids), "nothing left to compute"
        for block in prefix_block_ids:
            self.block_refs[block] = self.block_refs.get(block, 0) + 1
        request = DriverRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            block_ids=list(prefix_block_ids),
            num_computed_tokens=num_computed_tokens,
            keep_blocks=keep_blocks,
            copy_blocks=list(copy_blocks),
            output_token_ids=list(output_token_ids),
            lora_name=lora_name,
        )
        self.requests[request_id] = request
        return request

    @property
    def has_unfinished(self) -> bool:
        return any(not request.finished for request in self.requests.values())

    def run(self) -> dict[str, DriverRequest]:
        while self.has_unfinished:
            self.step()
        return self.requests

    def step(self) -> ModelRunnerOutput:
        scheduler_output = self._schedule()
        self.last_output = scheduler_output
        runner_output = self.runner.execute(scheduler_output)
        self._update(scheduler_output, runner_output)
        return runner_output

    def _schedule(self) -> SchedulerOutput:
        unfinished = [request for request in self.requests.values() if not request.finished]
        decodes = [request for request in unfinished if request.num_tokens - request.num_computed_tokens == 1]
        prefills = [request for request in unfinished if request.num_tokens - request.num_computed_tokens > 1]
        budget = self.token_budget
        num_scheduled: dict[str, int] = {}
        for request in decodes + prefills:
            count = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.prefill_chunk_size is not None:
                count = min(count, self.prefill_chunk_size)
            if count <= 0:
                break
            self._grow_block_table(request, request.num_computed_tokens + count)
            num_scheduled[request.request_id] = count
            budget -= count
        return self._build_output(num_scheduled)

    def _grow_block_table(self, request: DriverRequest, num_tokens: int) -> None:
        missing = -(-num_tokens // self.block_size) - len(request.block_ids)
        if missing > 0:
            blocks = self.allocate_blocks(missing)
            request.block_ids.extend(blocks)
            request.unsent_block_ids.extend(blocks)

    def _build_output(self, num_scheduled: dict[str, int]) -> SchedulerOutput:
        new_requests: list[NewRequestData] = []
        cached_requests: list[CachedRequestData] = []
        copy_blocks: list[tuple[int, int]] = []
        for request_id in num_scheduled:
            request = self.requests[request_id]
            if not request.sent:
                new_requests.append(NewRequestData(
                    request_id, request.prompt_token_ids, list(request.output_token_ids),
                    request.sampling_params, list(request.block_ids), request.num_computed_tokens,
                    request.lora_name,
                ))
                copy_blocks.extend(request.copy_blocks)
                request.sent = True
            else:
                cached_requests.append(CachedRequestData(
                    request_id, list(request.unsent_block_ids), request.num_computed_tokens
                ))
            request.unsent_block_ids.clear()
        finished, self.finished_since_last_step = self.finished_since_last_step, set()
        return SchedulerOutput(
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_request_ids=finished,
            copy_blocks=copy_blocks,
        )

    def _update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for request_id, count in scheduler_output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += count
            token_id = runner_output.sampled_token_ids.get(request_id)
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            if request_id in runner_output.logprobs:
                request.logprobs.append(runner_output.logprobs[request_id])
            request.finish_reason = self._finish_reason(request, token_id)
            if request.finished:
                self.finished_since_last_step.add(request_id)
                if not request.keep_blocks:
                    self.free_blocks(request.block_ids)

    def _finish_reason(self, request: DriverRequest, token_id: int) -> FinishReason | None:
        params = request.sampling_params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            return FinishReason.STOP
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
