"""Drawing one token per row from logits and one uniform number per row.

    token_ids = sample_rows(logits, rows)     # rows: RowParams; CPU fp32 through our C kernel

Per row: penalties (repetition, presence, frequency) over the tokens the row has seen, then
temperature, then top-k, then top-p within the top-k set, then min-p, then a draw from softmax
over the kept tokens. The draw is an inverse CDF: with target = u * (sum of the
kept e_i), e_i = exp((logit_i - max) / T), the token is the first, in index order, at which the
running sum of the kept e_i exceeds target. So token i comes out with probability
e_i / (sum of the kept e_i) from a single uniform number u, and a row's token is a function of
its logits, its parameters and its u alone.

The kept set, as a sort-then-mask sampler defines it (ties keep their lower indices, as a
stable descending sort would):

- top-k: the k largest;
- top-p: the smallest prefix of the top-k set, largest first, whose mass reaches top_p of the
  top-k set's mass (a token is kept when the tokens before it hold less than top_p);
- min-p: p_i >= min_p * p_max.

Two implementations give the same distribution:

- `sample_rows_torch`: plain torch, one stable sort per row when top-k or top-p is on, then a
  cumulative sum and a searchsorted. The oracle, the GPU path (no host sync per row) and the
  fallback where the C kernels do not build.
- our C kernel (csrc/sampler.c): no sort of the vocabulary: a histogram of the exp values finds
  the buckets where top-k and top-p end, and only those are sorted. A row per task.

Rows with temperature 0 are greedy (argmax). A row holding NaN, or no finite logit, also gets
argmax's answer. Rows under a grammar sample only what its bitmask allows (AllowedTokens): the
kernel reads the bits, the torch path masks a copy of the logits.
"""

from __future__ import annotations

import ctypes
import functools
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["AllowedTokens", "RowParams", "apply_allowed_tokens", "apply_penalties", "native_sampler_available",
           "sample_rows", "sample_rows_native", "sample_rows_torch"]


@dataclass(slots=True)
class RowParams:
    """Per-row parameters, aligned with the rows of the logits: one float64 row each, on the CPU
    (one tensor, built in one call: a decode step builds it every time), and the token history
    of the rows with penalties."""

    table: torch.Tensor  # [rows, NUM_COLUMNS] float64, the columns below
    history: torch.Tensor | None = None  # int32: the penalized rows' prompt + output ids, concatenated
    history_spans: torch.Tensor | None = None  # [rows, 3] int64: prompt history[s0:s1], output history[s1:s2]

    TEMPERATURE, TOP_K, TOP_P, MIN_P, UNIFORM, REPETITION, PRESENCE, FREQUENCY = range(8)
    NUM_COLUMNS = 8
    # temperature: 0 is greedy | top_k: 0 or >= vocab keeps all | top_p: in (0, 1], 1 keeps all |
    # min_p: in [0, 1], 0 drops none | uniform: the row's random number, in [0, 1) |
    # repetition (1: none; HF/vLLM, over prompt and output), presence and frequency (0: none;
    # OpenAI, over the output): penalties, which need the history

    @classmethod
    def of(cls, temperatures: list[float], top_ks: list[int], top_ps: list[float], min_ps: list[float],
           uniforms: list[float] | torch.Tensor) -> RowParams:
        """Rows without penalties."""
        uniforms = uniforms.tolist() if isinstance(uniforms, torch.Tensor) else uniforms
        return cls.from_rows([(*row, 1.0, 0.0, 0.0) for row in zip(temperatures, top_ks, top_ps, min_ps, uniforms)])

    @classmethod
    def from_rows(cls, rows: list[tuple[float, ...]], histories: list[tuple[Sequence[int], int] | None] | None = None
                  ) -> RowParams:
        """rows: NUM_COLUMNS values each; histories: per row (prompt + output ids, prompt length)
        or None (no penalties), read only where a row has penalties. Ids in an int32 array
        ("i": the runner keeps one per penalized request) are read in place, a list converted."""
        table = torch.tensor(rows, dtype=torch.float64).view(-1, cls.NUM_COLUMNS)
        if histories is None or not any(history is not None for history in histories):
            return cls(table)
        parts, spans, start = [], [], 0
        for history in histories:
            tokens, num_prompt = history if history is not None else ((), 0)
            if len(tokens):  # an array("i") is taken as it is, a list converted
                parts.append(torch.frombuffer(tokens, dtype=torch.int32) if isinstance(tokens, array)
                             else torch.tensor(tokens, dtype=torch.int32))
            spans.append((start, start + num_prompt, start + len(tokens)))
            start += len(tokens)
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)
        return cls(table, flat, torch.tensor(spans, dtype=torch.int64))

    def column(self, index: int) -> torch.Tensor:
        return self.table[:, index]

    def penalized_rows(self) -> list[int]:
        if self.history is None:
            return []
        t = self.table
        return torch.nonzero((t[:, self.REPETITION] != 1) | (t[:, self.PRESENCE] != 0) | (t[:, self.FREQUENCY] != 0)
                             ).view(-1).tolist()


@dataclass(slots=True)
class AllowedTokens:
    """Which tokens each grammar-constrained row may sample (workers/grammar.py fills it)."""

    rows: torch.Tensor  # [num_constrained] int64 logits rows under a grammar
    bitmask: torch.Tensor  # [num_constrained, ceil(vocab / 32)] int32; bit t % 32 of word t // 32: token t allowed


def apply_allowed_tokens(logits: torch.Tensor, allowed: AllowedTokens) -> torch.Tensor:
    """A copy of logits with the tokens each constrained row may not sample set to -inf (the
    torch path; the CPU kernel reads the bitmask itself)."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    unpacked = (allowed.bitmask.unsqueeze(-1) >> bits) & 1  # [rows, words, 32]
    forbidden = unpacked.view(allowed.bitmask.shape[0], -1)[:, :vocab] == 0
    logits = logits.clone()
    logits[allowed.rows] = logits[allowed.rows].masked_fill_(forbidden, float("-inf"))
    return logits


def sample_rows(logits: torch.Tensor, rows: RowParams, workspace: torch.Tensor | None = None,
                allowed: AllowedTokens | None = None) -> torch.Tensor:
    """[rows] int64 token ids (on the logits' device). logits: [rows, vocab] fp32, not modified;
    allowed: the rows under a grammar and what they may sample. CPU fp32 rows go through our C
    kernel where it builds; workspace is its scratch (grown in place when too small: pass the
    same tensor each call to reuse it)."""
    if _native_kernel() is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        return sample_rows_native(logits, rows, workspace, allowed)
    logits = apply_penalties(logits, rows)
    return sample_rows_torch(apply_allowed_tokens(logits, allowed) if allowed is not None else logits, rows)


def apply_penalties(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """logits with each penalized row's penalties applied (a copy; the same tensor if no row has
    any): the torch path of what the kernel does, over each row's distinct tokens only."""
    penalized = rows.penalized_rows()
    if not penalized:
        return logits
    logits = logits.clone()
    table, spans = rows.table.tolist(), rows.history_spans.tolist()
    for row in penalized:
        start, prompt_end, end = spans[row]
        repetition, presence, frequency = table[row][RowParams.REPETITION:]
        values = logits[row]
        if repetition != 1.0:  # HF/vLLM: over prompt and output tokens
            seen = torch.unique(rows.history[start:end].long()).to(logits.device)
            picked = values[seen]
            values[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
        if (presence != 0.0 or frequency != 0.0) and end > prompt_end:  # OpenAI: over output tokens only
            ids, counts = torch.unique(rows.history[prompt_end:end].long(), return_counts=True)
            ids, counts = ids.to(logits.device), counts.to(logits.device, torch.float32)
            values[ids] = values[ids] - frequency * counts - presence
    return logits


@torch.inference_mode()
def sample_rows_torch(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    table = rows.table.to(device)
    temperatures = table[:, RowParams.TEMPERATURE].float()
    top_ks_cpu, top_ps_cpu = rows.column(RowParams.TOP_K), rows.column(RowParams.TOP_P)  # decided on the host
    greedy = logits.argmax(dim=-1)
    peak = logits.max(dim=-1, keepdim=True).values
    drawn = (temperatures > 0) & torch.isfinite(peak[:, 0]) & ~torch.isnan(logits).any(dim=-1)
    safe_t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    e = torch.exp((logits - torch.where(drawn[:, None], peak, torch.zeros_like(peak))) / safe_t[:, None])
    kept = e > 0
    top_ks = table[:, RowParams.TOP_K].long()
    top_ks = torch.where((top_ks > 0) & (top_ks < vocab), top_ks, vocab)
    if bool(((top_ks_cpu > 0) & (top_ks_cpu < vocab)).any()) or bool((top_ps_cpu < 1).any()):
        sorted_e, order = e.sort(dim=-1, descending=True, stable=True)
        ranks = torch.arange(vocab, device=device)
        sorted_e = torch.where(ranks < top_ks[:, None], sorted_e, torch.zeros_like(sorted_e))
        mass = sorted_e.double().cumsum(dim=-1)
        top_ps = table[:, RowParams.TOP_P, None]
        in_nucleus = (mass - sorted_e.double() < top_ps * mass[:, -1:]) | (top_ps >= 1.0)
        kept = torch.zeros_like(kept).scatter_(1, order, (sorted_e > 0) & in_nucleus)
    kept &= e >= table[:, RowParams.MIN_P, None].float()
    cdf = torch.where(kept, e.double(), torch.zeros((), dtype=torch.float64, device=device)).cumsum(dim=-1)
    target = table[:, RowParams.UNIFORM, None] * cdf[:, -1:]
    token = torch.searchsorted(cdf, target, right=True)[:, 0]
    last_kept = torch.where(kept, torch.arange(vocab, device=device), -1).max(dim=-1).values
    return torch.where(drawn, torch.minimum(token, last_kept), greedy)


@functools.cache
def _native_kernel():
    """Our C sampler (csrc/sampler.c), or None where the kernels cannot be built."""
    from workers.kernels.native import NativeBuildError, native_library

    try:
        return native_library().rayllm_sample
    except NativeBuildError:
        return None


def native_sampler_available() -> bool:
    return _native_kernel() is not None


def sample_rows_native(logits: torch.Tensor, rows: RowParams, workspace: torch.Tensor | None = None,
                       allowed: AllowedTokens | None = None) -> torch.Tensor:
    from workers.kernels.native import SampleArgs, check_status

    num_rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1, logits.stride()
    table = rows.table
    assert table.dtype == torch.float64 and table.shape == (num_rows, RowParams.NUM_COLUMNS) and table.is_contiguous()
    out = torch.empty(num_rows, dtype=torch.long)
    if num_rows == 0:
        return out
    needed = num_rows * vocab
    if workspace is None or workspace.numel() < needed:
        workspace = torch.empty(needed, dtype=torch.float32) if workspace is None else workspace.resize_(needed)
    bitmask, words = None, 0
    if allowed is not None:  # every row gets a mask row; a free row's allows everything
        words = allowed.bitmask.shape[1]
        assert words * 32 >= vocab and allowed.bitmask.dtype == torch.int32, (allowed.bitmask.shape, vocab)
        bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)
        bitmask[allowed.rows.cpu()] = allowed.bitmask.cpu()
    history, spans = rows.history, rows.history_spans
    if history is not None:
        assert history.dtype == torch.int32 and spans.dtype == torch.int64 and spans.shape == (num_rows, 3)
    args = SampleArgs(logits.data_ptr(), workspace.data_ptr(), table.data_ptr(),
                      bitmask.data_ptr() if bitmask is not None else None,
                      history.data_ptr() if history is not None else None,
                      spans.data_ptr() if spans is not None else None, out.data_ptr(), num_rows, vocab,
                      logits.stride(0), words, torch.get_num_threads(), 0)
    check_status(_native_kernel()(ctypes.byref(args)), "rayllm_sample")
    return out
