"""Sampler: one token per sampling row from fp32 logits, vectorized over the batch.

Order of operations per row (rows only pay for what their params ask):

    raw logits --> logprobs (log_softmax of the RAW logits, sampled token + top-k)
       |
       +-> every row greedy, with no penalty and no grammar: argmax
       +-> otherwise one call for the batch (workers/kernels/sampling.py), each row on its own:
           grammar rows: tokens their grammar forbids -> -inf (a bitmask per constrained row)
           -> penalties: repetition (prompt + output, HF/vLLM), presence and frequency (output,
              OpenAI), over the tokens the row has seen, not the vocabulary
           -> greedy rows argmax; the others temperature -> top-k -> top-p -> min-p -> a draw
              from one uniform number

Each sampled row takes one uniform number u in [0, 1) and the kernel turns it into a token by
the inverse CDF of the row's distribution. A seeded request's u comes from (seed, output
position) alone, through an integer hash, so the same seed gives the same tokens whatever else
is in the batch, after preemption, and on another worker running the same kernel build.
Unseeded rows take theirs from one shared generator.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.outputs import TokenLogprobs
from scheduler.sampling_params import SamplingParams
from workers.kernels.sampling import AllowedTokens, RowParams, sample_rows

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def seeded_uniform(seed: int, output_position: int) -> float:
    """The uniform number in [0, 1) that draws a seeded request's token at output_position (0-based)."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ output_position) >> 11) * 2.0 ** -53


@dataclass(slots=True)
class SamplingBatch:
    """What the sampler needs per row, aligned with the rows of the logits."""

    params: list[SamplingParams]
    output_positions: list[int]  # output index of the token sampled now (= tokens generated so far)
    token_ids: list[Sequence[int]]  # prompt + output ids so far (read only; for penalties)
    num_prompt_tokens: list[int]  # where the prompt ends inside token_ids
    allowed_tokens: AllowedTokens | None = None  # the rows under a grammar and their bitmask; None: no row is


@functools.cache
def _argmax_kernel():
    """Our C argmax (workers/kernels/csrc/layer_ops.c), or None where the kernels cannot be built."""
    from workers.kernels.native import NativeBuildError, check_status, native_library

    try:
        kernel = native_library().rayllm_argmax
    except NativeBuildError:
        return None
    return lambda *args: check_status(kernel(*args), "rayllm_argmax")


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the same answers (the first index on ties, a NaN wins). CPU fp32
    rows go through our C kernel: torch's CPU argmax read a decode step's 16 x 49152 logits at
    about 5 GB/s a thread, 0.3-0.7 ms of a 20 ms step."""
    kernel = _argmax_kernel() if (logits.device.type == "cpu" and logits.dtype == torch.float32
                                  and logits.dim() == 2 and logits.shape[0] > 0 and logits.is_contiguous()) else None
    if kernel is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.long)
    kernel(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1], torch.get_num_threads())
    return out


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row, None where the row did not ask


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.random = random.Random(seed)  # the unseeded rows' uniform numbers
        self.workspace = torch.empty(0)  # the CPU kernel's scratch, grown to the largest batch

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [num_rows, vocab] fp32 raw model logits (not modified)."""
        params = batch.params
        logprobs = self._logprobs_rows(logits, params)  # before anything touches the logits
        if batch.allowed_tokens is None and all(p.is_greedy and not p.has_penalties for p in params):
            token_ids = argmax_rows(logits)
        else:  # penalties and grammar masks are applied inside, each row on its own copy
            token_ids = sample_rows(logits, self.row_params(batch), self.workspace, batch.allowed_tokens)
        token_list = token_ids.tolist()
        return SamplerOutput(token_list, self._fill_logprobs(logprobs, token_list, params))

    def row_params(self, batch: SamplingBatch) -> RowParams:
        """The kernel's per-row parameters: greedy rows get temperature 0, every row a uniform
        number, and rows with penalties their token history."""
        draw = self.random.random
        rows = [(p.temperature, p.top_k or 0, p.top_p, p.min_p,
                 draw() if p.seed is None else seeded_uniform(p.seed, position),
                 p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
                for p, position in zip(batch.params, batch.output_positions)]
        histories = None
        if any(p.has_penalties for p in batch.params):
            histories = [(tokens, num_prompt) if p.has_penalties else None
                         for p, tokens, num_prompt in zip(batch.params, batch.token_ids, batch.num_prompt_tokens)]
        return RowParams.from_rows(rows, histories)

    def _logprobs_rows(self, logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list[int], torch.Tensor] | None:
        rows = [row for row, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        return rows, torch.log_softmax(logits[rows], dim=-1)

    def _fill_logprobs(self, logprobs: tuple[list[int], torch.Tensor] | None, token_ids: list[int],
                       params: list[SamplingParams]) -> list[TokenLogprobs | None]:
        result: list[TokenLogprobs | None] = [None] * len(params)
        if logprobs is None:
            return result
        rows, table = logprobs
        sampled = table.gather(1, torch.tensor([[token_ids[row]] for row in rows], device=table.device))
        sampled_list = sampled.view(-1).tolist()
        max_k = max(params[row].logprobs for row in rows)
        top_values, top_ids = table.topk(max_k, dim=-1) if max_k > 0 else (table[:, :0], table[:, :0].long())
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for position, row in enumerate(rows):
            k = params[row].logprobs
            top = list(zip(top_ids[position][:k], top_values[position][:k]))
            result[row] = TokenLogprobs(token_ids[row], sampled_list[position], top)
        return result
