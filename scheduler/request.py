"""The scheduler's per-sequence state. Mutated only by the Scheduler.

One `Request` is one sequence. An n>1 client request starts as one *fork parent* (index 0,
n sequences reserved) that computes the prompt up to its last token; the scheduler then
replaces it by n children (`f"{parent}-{i}"`, index i, params `for_child(i)`) that carry the
parent's client id in their outputs. See scheduler.outputs for the token layout.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

from scheduler.block_hash import BlockHash, BlockHasher, adapter_root
from scheduler.outputs import FinishReason
from scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status after PREEMPTED is a finished one."""

    WAITING = 0  # queued, never admitted
    RUNNING = 1  # admitted: holds KV blocks
    PREEMPTED = 2  # queued again after preemption or migration: holds no blocks
    FINISHED_STOPPED = 3  # EOS or a stop token id
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5  # client gone, stop string, timeout, shutdown

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class ReadOnlyTokens(Sequence[int]):
    """A read-only view of a token list (no copy)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        return self._tokens[i]

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReadOnlyTokens):
            return self._tokens == other._tokens
        return isinstance(other, list) and self._tokens == other

    def __repr__(self) -> str:
        return f"ReadOnlyTokens({self._tokens!r})"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str  # unique within a scheduler; a fork child's is f"{parent}-{index}"
    client_request_id: str  # the id outputs carry: the parent's for n>1 children
    prompt_token_ids: list[int]  # never changes, also not on migration
    sampling_params: SamplingParams  # a child's are the parent's .for_child(index)
    block_hasher: BlockHasher | None  # hashes full blocks; None: prefix caching is off
    arrival_time: float = 0.0  # seconds, engine clock
    lora_name: str | None = None  # the LoRA adapter the worker applies; None: the base model
    lora_path: str | None = None  # its directory, as registered when the request arrived
    index: int = 0  # sequence index within n (0 for a fork parent)
    parent_request_id: str | None = None  # set on fork children
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in this worker's pool (the one currency)
    num_cached_tokens: int = 0  # prompt tokens hit in the prefix cache at first admission (block-rounded)
    num_preemptions: int = 0  # times preempted or migrated
    sent_to_worker: bool = False  # the worker holds per-request state (was sent as NewRequestData)
    # a fork child of a model with recurrent layers: the worker holds its states from the fork on, sent or not
    # (SchedulerOutput.state_forks), until it is told to forget it
    fork_state_on_worker: bool = False
    queued_at_step: int = 0  # steps the scheduler had handed out when this was queued
    _output_token_ids: list[int] = field(init=False)  # generated tokens, in order
    _all_token_ids: list[int] = field(init=False)  # prompt + generated
    _block_hashes: list[BlockHash] = field(init=False)  # hash of each full block of _all_token_ids
    _hash_root: BlockHash | None = field(init=False)  # block 0's parent: its adapter's (None: the base model's)

    def __post_init__(self) -> None:
        assert len(self.prompt_token_ids) >= 1, self.request_id
        self._output_token_ids = []
        self._all_token_ids = list(self.prompt_token_ids)
        self._block_hashes = []
        self._hash_root = adapter_root(self.lora_name, self.lora_path)
        if self.block_hasher is not None:
            self.block_hasher.extend(self._block_hashes, self._all_token_ids, self._hash_root)

    # --- read-only views -------------------------------------------------------------
    @property
    def output_token_ids(self) -> ReadOnlyTokens:
        return ReadOnlyTokens(self._output_token_ids)

    @property
    def all_token_ids(self) -> ReadOnlyTokens:
        return ReadOnlyTokens(self._all_token_ids)

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        return self._block_hashes

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_fork_parent(self) -> bool:
        """An n>1 request not forked yet: it computes the prompt up to its last token."""
        return self.sampling_params.n > 1

    @property
    def num_seqs(self) -> int:
        """Sequences this request will occupy in the running batch."""
        return self.sampling_params.n

    @property
    def num_tokens_to_compute(self) -> int:
        """Where num_computed_tokens is headed: a fork parent stops one short of its prompt."""
        if self.is_fork_parent:
            return self.num_prompt_tokens - 1
        return self.num_tokens

    # --- the only writer of the token lists --------------------------------------------
    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Appends generated tokens and hashes every block they fill."""
        if isinstance(token_ids, int):
            self._output_token_ids.append(token_ids)
            self._all_token_ids.append(token_ids)
        else:
            self._output_token_ids.extend(token_ids)
            self._all_token_ids.extend(token_ids)
        hasher = self.block_hasher
        if hasher is not None and len(self._all_token_ids) >= (len(self._block_hashes) + 1) * hasher.block_size:
            hasher.extend(self._block_hashes, self._all_token_ids, self._hash_root)

    def make_fork_child(self, index: int) -> Request:
        """The index-th child of this fork parent: same prompt and hashes, its own params.

        Progress and blocks are the caller's (scheduler + KV manager) to set.
        """
        assert self.is_fork_parent and self.num_output_tokens == 0, self.request_id
        child = Request(
            request_id=f"{self.request_id}-{index}",
            client_request_id=self.client_request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params.for_child(index),
            block_hasher=None,  # the parent's hashes are copied below, not recomputed
            arrival_time=self.arrival_time,
            lora_name=self.lora_name,
            lora_path=self.lora_path,
            index=index,
            parent_request_id=self.request_id,
            num_cached_tokens=self.num_cached_tokens,
        )
        child.block_hasher = self.block_hasher
        child._block_hashes = list(self._block_hashes)
        return child

    def reset_for_recompute(self) -> None:
        """Preemption or migration: the KV is gone, the tokens stay (recompute later)."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_preemptions += 1
        self.sent_to_worker = False
        self.fork_state_on_worker = False
