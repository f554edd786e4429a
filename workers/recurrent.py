"""Layers that keep a fixed-size state per sequence instead of keys and values per token.

A short convolution (LFM2), a Gated DeltaNet (Qwen3-Next, Kimi Linear's KDA) or a Mamba-2 mixer (Granite 4)
reads a sequence's tokens in order and folds each into a state: the last L - 1 inputs of a
causal convolution, a matrix per head of a linear attention or a state-space model. The
state's size does not grow with the tokens, so these layers add nothing to the paged KV pool.

The state pool of a recurrent layer is a tuple of tensors, each [num_rows, *shape] (a
mixer's `state_specs`). Rows 0 .. max_num_seqs are the worker's per-sequence rows (the
runner gives each running sequence one, zeroed when its computation starts at token 0);
the rows after them keep snapshots: the state of some sequence at a block boundary, copied
there so that a later request whose prompt starts with the same blocks continues from it
(the scheduler's prefix cache, scheduler/state_snapshots.py).

A mixer implements:

    state_specs() -> ((shape, dtype), ...)            one entry per state tensor of a sequence
    prefill(model, x, pool, row) -> y                 one sequence's n >= 1 tokens [n, hidden], in
                                                      order, continuing from pool[i][row] (updated)
    decode(model, x, pool, rows) -> y                 one token per sequence [s, hidden]; rows [s]
                                                      int64; pool[i][rows] updated

where x is the layer's normed input and y its output before the residual add. StateStep and
run_mixer below split a step's sequences between the two and take the snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

StatePool = tuple[torch.Tensor, ...]  # each [num_rows, *shape]: a recurrent layer's states


@dataclass(slots=True)
class StateStep:
    """Where each sequence of a step keeps its recurrent state (shared by every recurrent layer)."""

    query_start_loc: list[int]  # [num_seqs + 1]: each sequence's rows in the step's tokens
    rows: list[int]  # [num_seqs]: each sequence's row in every state pool
    # sequence index -> (tokens of its chunk after which its state is copied, the snapshot's pool row)
    saves: dict[int, tuple[int, int]] = field(default_factory=dict)
    rows_tensor: torch.Tensor | None = None  # rows as int64 on the device, built on first use

    def decode_sequences(self) -> list[int]:
        """Sequences that compute one token and take no snapshot: one batched decode."""
        starts = self.query_start_loc
        return [i for i in range(len(self.rows)) if starts[i + 1] - starts[i] == 1 and i not in self.saves]


def copy_rows(pools: list[StatePool], sources: list[int], destinations: list[int]) -> None:
    """Every recurrent layer's state rows sources copied to destinations (a fork, a snapshot's
    save or restore)."""
    if not sources:
        return
    for pool in pools:
        device = pool[0].device
        src = torch.tensor(sources, dtype=torch.long, device=device)
        dst = torch.tensor(destinations, dtype=torch.long, device=device)
        for tensor in pool:
            tensor.index_copy_(0, dst, tensor.index_select(0, src))


def zero_rows(pools: list[StatePool], rows: list[int]) -> None:
    """The rows' states zeroed: a sequence whose computation starts at its first token."""
    if not rows:
        return
    for pool in pools:
        index = torch.tensor(rows, dtype=torch.long, device=pool[0].device)
        for tensor in pool:
            tensor.index_fill_(0, index, 0)


def run_mixer(mixer, model, x: torch.Tensor, pool: StatePool, step: StateStep) -> torch.Tensor:
    """The mixer over a step's tokens x [num_tokens, hidden]: its one-token sequences in one
    batched decode, every other sequence alone, in order; a sequence with a save is cut there,
    and its state copied to the snapshot row between the two halves."""
    singles = step.decode_sequences()
    if len(singles) == len(step.rows):  # a decode step: every row is a sequence
        if step.rows_tensor is None:
            step.rows_tensor = torch.tensor(step.rows, dtype=torch.long, device=x.device)
        return mixer.decode(model, x, pool, step.rows_tensor)
    out = torch.empty_like(x)  # a mixer's output is [tokens, hidden] too
    starts = step.query_start_loc
    if singles:
        rows = torch.tensor([starts[i] for i in singles], dtype=torch.long, device=x.device)
        slots = torch.tensor([step.rows[i] for i in singles], dtype=torch.long, device=x.device)
        out.index_copy_(0, rows, mixer.decode(model, x.index_select(0, rows), pool, slots))
    single = set(singles)
    for i, row in enumerate(step.rows):
        if i in single:
            continue
        begin, end = starts[i], starts[i + 1]
        cut, snapshot = step.saves.get(i, (end - begin, None))
        if cut > 0:
            out[begin:begin + cut] = mixer.prefill(model, x[begin:begin + cut], pool, row)
        if snapshot is not None:
            copy_rows([pool], [row], [snapshot])
        if begin + cut < end:
            out[begin + cut:end] = mixer.prefill(model, x[begin + cut:end], pool, row)
    return out


# A prompt's chunked scans weight tokens by exp(log decay); below e^-60 (1e-26) such a weight is
# taken as 0. Left as they come, they reach subnormal floats (below 1.2e-38) in the products that
# follow, which x86 computes about 100x slower: at Qwen3.5's heads a random checkpoint's 496-token
# chunked delta rule took 72 ms against 29 for the same shapes without them (47 ms of it in bmm), and
# setting flush-to-zero (per thread, so torch's other threads kept them) only got it to 58. What is
# dropped is 19 orders of magnitude below fp32's rounding of any term it would be added to.
LOG_DECAY_FLOOR = -60.0


def decay_weights(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), with 0 where log_decay < LOG_DECAY_FLOOR (-inf included)."""
    return torch.exp(log_decay).masked_fill_(log_decay < LOG_DECAY_FLOOR, 0.0)


def unit_lower_solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """T^-1 rhs for the unit lower-triangular T whose strictly lower part is system's ([..., L, L];
    its diagonal and upper part unread), rhs [..., L, M]: the chunked delta rules' solves, in torch
    (the layer ops' reference: workers/layer_ops.py)."""
    return torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                state: torch.Tensor) -> torch.Tensor:
    """A depthwise causal convolution over one sequence's next tokens, continuing from its state.

    x [n, channels]; weight [channels, width]; state [width - 1, channels]: the inputs of the
    width - 1 tokens before x (zeros before the first token), replaced by the last width - 1
    inputs of state ++ x. Returns [n, channels], y[t, c] = sum_j weight[c, j] * u[t + j, c] with
    u = state ++ x along the tokens (bias added), summed in fp32. No activation. One multiply-add
    per tap over whole rows: torch's depthwise conv1d took 40 ms for 512 tokens of 1024 channels
    in bf16, these a few."""
    num_tokens, width = x.shape[0], weight.shape[1]
    joined = torch.cat([state.to(x.dtype), x], dim=0)  # [width - 1 + n, channels]
    y = x.float() * weight[:, -1].float()
    for tap in range(width - 1):
        y.addcmul_(joined[tap:tap + num_tokens].float(), weight[:, tap].float())
    if bias is not None:
        y += bias.float()
    state.copy_(joined[num_tokens:])
    return y.to(x.dtype)


def causal_conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor,
                     rows: torch.Tensor) -> torch.Tensor:
    """causal_conv for one token of each of s sequences: x [s, channels], their states
    states[rows] [s, width - 1, channels] (updated in place). A multiply-add per tap over whole
    rows, in fp32 (a reduction over the few taps of each channel is 100x slower in torch)."""
    old = states.index_select(0, rows)  # [s, width - 1, channels]
    y = x.float() * weight[:, -1].float()
    for tap in range(weight.shape[1] - 1):
        y.addcmul_(old[:, tap].float(), weight[:, tap].float())
    if bias is not None:
        y += bias.float()
    states.index_copy_(0, rows, torch.cat([old[:, 1:], x.unsqueeze(1).to(states.dtype)], dim=1))
    return y.to(x.dtype)


class StateRows:
    """The worker's state pools and which row each request holds, and how far its state has got.

    Rows [0, num_snapshots) keep prefix-cache snapshots (the scheduler's numbering); the rows
    after them are handed to requests. A request's state must have folded exactly the tokens
    before the ones a step computes: `step` checks that, so a state that fell out of step with
    the KV fails loudly instead of answering wrong."""

    def __init__(self, specs: list[tuple[tuple[tuple[int, ...], torch.dtype], ...] | None], num_seqs: int,
                 num_snapshots: int, device: torch.device):
        self.specs = specs  # per layer: its mixer's state specs; None: an attention layer
        self.num_snapshots = num_snapshots
        self.device = device
        self.pools: list[StatePool | None] = [None] * len(specs)
        self.num_rows = 0
        self.free: list[int] = []
        self.row_of: dict[str, int] = {}  # request id -> its row
        self.position: dict[str, int] = {}  # request id -> tokens its state has folded
        self.num_grows = 0  # times the pools were replaced by larger ones (their holders must look again)
        self._grow(num_snapshots + num_seqs)

    @staticmethod
    def bytes_per_row(specs: list[tuple[tuple[tuple[int, ...], torch.dtype], ...] | None]) -> int:
        total = 0
        for layer in specs:
            for shape, dtype in layer or ():
                total += torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        return total

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.bytes_per_row(self.specs)

    def _grow(self, num_rows: int) -> None:
        """At least num_rows rows in every pool, the old rows' states kept."""
        if num_rows <= self.num_rows:
            return
        for index, layer in enumerate(self.specs):
            if layer is None:
                continue
            grown = tuple(torch.zeros((num_rows, *shape), dtype=dtype, device=self.device) for shape, dtype in layer)
            old = self.pools[index]
            for new, kept in zip(grown, old or ()):
                new[:self.num_rows] = kept
            self.pools[index] = grown
        self.free.extend(range(num_rows - 1, max(self.num_rows, self.num_snapshots) - 1, -1))
        self.num_rows = num_rows

    def _row(self, request_id: str) -> int:
        row = self.row_of.get(request_id)
        if row is None:
            if not self.free:  # more sequences at once than planned for (forks in flight): grow by half
                self._grow(self.num_rows + max(4, (self.num_rows - self.num_snapshots) // 2))
                self.num_grows += 1
            row = self.row_of[request_id] = self.free.pop()
        return row

    @property
    def layer_pools(self) -> list[StatePool]:
        return [pool for pool in self.pools if pool is not None]

    def fork(self, parent: str, child: str) -> None:
        """The child's state is the parent's (an n>1 fork), whenever the child is first scheduled."""
        if parent not in self.row_of:
            raise KeyError(f"fork of {parent!r}, whose state this worker does not hold")
        row = self._row(child)  # first: it may grow the pools
        copy_rows(self.layer_pools, [self.row_of[parent]], [row])
        self.position[child] = self.position[parent]

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        self.position.pop(request_id, None)
        if row is not None:
            self.free.append(row)

    def start(self, request_id: str, num_computed_tokens: int, snapshot: int | None) -> None:
        """A request sent to the worker: its state from a snapshot, or from its fork, or zero."""
        if snapshot is not None:
            if not 0 <= snapshot < self.num_snapshots:
                raise ValueError(f"state snapshot {snapshot} of {self.num_snapshots}")
            row = self._row(request_id)
            copy_rows(self.layer_pools, [snapshot], [row])
        elif num_computed_tokens == 0:
            row = self._row(request_id)
            zero_rows(self.layer_pools, [row])
        elif self.position.get(request_id) != num_computed_tokens:
            raise StateLostError(f"request {request_id!r} starts at token {num_computed_tokens} with no state for it "
                                 "(no snapshot, no fork)")
        self.position[request_id] = num_computed_tokens

    def step(self, request_ids: list[str], starts: list[int], counts: list[int], query_start_loc: list[int],
             saves: dict[str, tuple[int, int]]) -> StateStep:
        """The StateStep of a step computing counts[i] tokens of request_ids[i] from starts[i];
        saves: request id -> (position, snapshot) to keep the state at that position."""
        rows, step_saves = [], {}
        for i, (request_id, start, count) in enumerate(zip(request_ids, starts, counts)):
            if self.position.get(request_id) != start:
                raise StateLostError(f"request {request_id!r}: the step computes from token {start}, its state holds "
                                     f"{self.position.get(request_id)} tokens")
            rows.append(self.row_of[request_id])
            self.position[request_id] = start + count
            save = saves.get(request_id)
            if save is not None:
                position, snapshot = save
                if not start <= position <= start + count or not 0 <= snapshot < self.num_snapshots:
                    raise ValueError(f"request {request_id!r}: snapshot {snapshot} at {position} outside "
                                     f"[{start}, {start + count}]")
                step_saves[i] = (position - start, snapshot)
        return StateStep(query_start_loc=query_start_loc, rows=rows, saves=step_saves)


class StateLostError(RuntimeError):
    """A step's tokens do not continue the state the worker holds for a request."""
