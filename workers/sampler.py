"""Sampler: one token per sampling row from fp32 logits, vectorized over the batch.

Order of operations per row (rows only pay for what their params ask):

    raw logits --> logprobs (log_softmax of the RAW logits, sampled token + top-k)
       |
       +-> penalties: repetition (prompt + output, HF/vLLM), presence and frequency (output, OpenAI)
       +-> grammar rows: tokens their grammar forbids -> -inf (a bitmask per constrained row)
       +-> greedy rows: argmax
       +-> other rows: / temperature -> top-k -> top-p -> min-p -> softmax -> draw

Drawing is an exponential race, argmax(probs / E) with E ~ Exp(1) per token, which picks
token i with probability probs[i]. The noise E of a seeded request comes from a generator
seeded from (seed, output position) alone, so the same seed gives the same tokens whatever
else is in the batch, after preemption, and on another worker. Unseeded rows draw their
noise together from one shared generator.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from scheduler.outputs import TokenLogprobs
from scheduler.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def position_seed(seed: int, output_position: int) -> int:
    """The generator seed for a seeded request's token at output_position (0-based)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_position) >> 1  # torch seeds are < 2**63


@dataclass(slots=True)
class SamplingBatch:
    """What the sampler needs per row, aligned with the rows of the logits."""

    params: list[SamplingParams]
    output_positions: list[int]  # output index of the token sampled now (= tokens generated so far)
    token_ids: list[Sequence[int]]  # prompt + output ids so far (read only; for penalties)
    num_prompt_tokens: list[int]  # where the prompt ends inside token_ids
    allowed_tokens: AllowedTokens | None = None  # the rows under a grammar and their bitmask; None: no row is


@dataclass(slots=True)
class AllowedTokens:
    """Which tokens each grammar-constrained row may sample (workers/grammar.py fills it)."""

    rows: torch.Tensor  # [num_constrained] int64 logits rows under a grammar
    bitmask: torch.Tensor  # [num_constrained, ceil(vocab / 32)] int32; bit t % 32 of word t // 32: token t allowed


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """A copy of logits with the tokens each constrained row may not sample set to -inf."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    unpacked = (allowed.bitmask.unsqueeze(-1) >> bits) & 1  # [rows, words, 32]
    forbidden = unpacked.view(allowed.bitmask.shape[0], -1)[:, :vocab] == 0
    logits = logits.clone()
    logits[allowed.rows] = logits[allowed.rows].masked_fill_(forbidden, float("-inf"))
    return logits


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
        self.generator = torch.Generator(device=self.device)  # shared by unseeded rows
        self.generator.manual_seed(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits: [num_rows, vocab] fp32 raw model logits (not modified)."""
        params = batch.params
        logprobs = self._logprobs_rows(logits, params)  # before anything touches the logits
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, batch)
        if batch.allowed_tokens is not None:
            logits = apply_allowed_tokens(logits, batch.allowed_tokens)
        if all(p.is_greedy for p in params):
            token_ids = argmax_rows(logits)
        else:
            token_ids = self._sample_mixed(logits, batch)
        token_list = token_ids.tolist()
        return SamplerOutput(token_list, self._fill_logprobs(logprobs, token_list, params))

    def _sample_mixed(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        params = batch.params
        token_ids = argmax_rows(logits)  # right for the greedy rows; the others are replaced
        random_rows = [row for row, p in enumerate(params) if not p.is_greedy]
        chosen = [params[row] for row in random_rows]
        index = torch.tensor(random_rows, device=logits.device)
        temperatures = torch.tensor([p.temperature for p in chosen], device=logits.device)
        scaled = logits[index] / temperatures[:, None]
        scaled = _top_k_top_p(scaled, [p.top_k for p in chosen], [p.top_p for p in chosen])
        if any(p.min_p > 0.0 for p in chosen):
            scaled = _min_p(scaled, torch.tensor([p.min_p for p in chosen], device=logits.device))
        probs = scaled.softmax(dim=-1)
        noise = self._exponential_noise(probs.shape, chosen, [batch.output_positions[row] for row in random_rows])
        token_ids[index] = argmax_rows(probs / noise)
        return token_ids

    def _exponential_noise(self, shape: torch.Size, params: list[SamplingParams],
                           output_positions: list[int]) -> torch.Tensor:
        noise = torch.empty(shape, device=self.device)
        unseeded = [row for row, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):
            noise.exponential_(generator=self.generator)
        else:
            if unseeded:
                shared = torch.empty(len(unseeded), shape[1], device=self.device)
                noise[unseeded] = shared.exponential_(generator=self.generator)
            for row, p in enumerate(params):
                if p.seed is not None:
                    generator = torch.Generator(device=self.device)
                    generator.manual_seed(position_seed(p.seed, output_positions[row]))
                    noise[row].exponential_(generator=generator)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # never divide by zero

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


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """A copy of logits with each row's repetition, presence and frequency penalties applied."""
    rows = [row for row, p in enumerate(batch.params) if p.has_penalties]
    logits = logits.clone()
    vocab = logits.shape[1]
    params = [batch.params[row] for row in rows]
    outputs = [list(batch.token_ids[row][batch.num_prompt_tokens[row]:]) for row in rows]
    output_counts = _token_counts(outputs, vocab, logits.device)
    index = torch.tensor(rows, device=logits.device)
    penalized = logits[index]
    if any(p.repetition_penalty != 1.0 for p in params):  # HF/vLLM: over prompt and output tokens
        repetition = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[:, None]
        seen = _token_counts([list(batch.token_ids[row]) for row in rows], vocab, logits.device) > 0
        scaled = torch.where(penalized > 0, penalized / repetition, penalized * repetition)
        penalized = torch.where(seen, scaled, penalized)
    # OpenAI: over output tokens only
    frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None]
    logits[index] = penalized - frequency * output_counts - presence * (output_counts > 0)
    return logits


def _token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] fp32 occurrence counts; one padded index tensor, one scatter_add."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    padded = [tokens + [vocab] * (width - len(tokens)) for tokens in token_lists]  # pad into a spare column
    index = torch.tensor(padded, dtype=torch.long, device=device).view(len(token_lists), width)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=counts.dtype))
    return counts[:, :vocab]


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int | None], top_ps: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (one sort for all rows)."""
    vocab = logits.shape[1]
    if all(k is None or k >= vocab for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    k = torch.tensor([vocab if k is None else min(k, vocab) for k in top_ks], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if any(p < 1.0 for p in top_ps):
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
        top_p = torch.tensor(top_ps, device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))  # rank 0 always stays
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)


def _min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))
