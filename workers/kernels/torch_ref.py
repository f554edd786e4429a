"""Paged attention in plain torch: the CPU path, and the oracle the Triton kernels are tested against.

The KV pool of one layer is [num_blocks, block_size, num_kv_heads, head_dim]; a sequence's
block table lists its blocks in order, so its position p lives in slot
block_table[p // block_size] * block_size + p % block_size.

One varlen call serves a whole step. Sequence s owns query rows
[query_start_loc[s], query_start_loc[s+1]) and has seq_lens[s] keys in the pool, the new
ones included (write_kv_cache runs first):

    keys:     [ cached prefix ............ | this step's tokens ]
              0              seq_len - query_len             seq_len
    query i sits at position seq_len - query_len + i and sees keys [0, that position].

So a prefill with a prefix hit, a prefill chunk and a decode (query_len == 1) are the same
case. Queries are cut into pieces of at most MAX_PIECE_QUERIES rows; pieces of similar shape
(all the decodes of similar lengths, equal-length prefills, ...) are padded into one SDPA
call, so the number of calls does not grow with the batch.

GQA: query head h reads kv head h // (num_heads // num_kv_heads). The query heads that share
a kv head are folded into the query-length dimension, so keys are never repeated.

Keys are gathered by whole blocks (index_select over the pool's block dimension); slots past
a piece's last position are masked. The per-step plan (pieces, gather indices, masks)
depends only on block_tables, query_start_loc and seq_lens, which every layer of a step
shares: it is built once and reused while the same (unmodified) tensors come back.

Per-layer variants (keyword arguments of paged_attention, each None by default: plain causal
softmax attention):

- window W (Gemma 2/3, gpt-oss sliding layers): the query at position p sees keys (p - W, p],
  its own and the W - 1 before it, as transformers' sliding_window_causal_mask_function;
- softcap c (Gemma 2): scores = c * tanh(scores / c) after the scale, before the mask and softmax;
- sinks [num_heads] (gpt-oss): one more logit per head in each softmax's denominator, with no
  value: out = sum_j e^(s_j) v_j / (e^sink + sum_j e^(s_j));
- attention_chunk C (Llama 4's RoPE layers): the query at position p sees keys
  [floor(p / C) * C, p], those of its own chunk of C positions, as transformers'
  chunked_causal_mask_function.

SDPA has no soft-cap nor sinks: a layer with either runs the same plan through an explicit
fp32 product, mask and softmax instead. A window or a chunk only changes the mask (built once
per plan, window and chunk, and kept while the plan is).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from workers.kernels import check_variants


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The standard pool, [num_blocks, block_size, num_kv_heads, head_dim] for K and for V,
    zeroed (the triton kernels use the same layout)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


@dataclass(slots=True)
class _SequenceGroup:
    """Query pieces attended in one SDPA call, padded to the same query and key length."""

    query_rows: torch.Tensor | slice  # [num_seqs * query_len] rows of q in padded order (padding repeats a row)
    output_rows: torch.Tensor | slice  # rows of the output that the real queries fill, in padded order
    real_queries: torch.Tensor | None  # positions of the real queries in padded order; None when no padding
    key_blocks: torch.Tensor  # [num_seqs, num_key_blocks] int64 block ids, whole blocks gathered
    query_len: int
    block_size: int
    pieces: tuple[tuple[int, int], ...]  # (num_queries, first_position) of each member, in padded order
    masks: dict = field(default_factory=dict)  # (window, chunk, dtype, heads) -> additive mask, built on first use

    def mask_for(self, group_size: int, dtype: torch.dtype, window: int | None = None,
                 attention_chunk: int | None = None) -> torch.Tensor:
        """[num_seqs, 1, group_size * query_len (or 1 row per query), keys] additive mask in dtype
        (0 sees, -inf not): rows ordered (head in group, query); a decode's mask broadcasts over heads."""
        heads = group_size if self.query_len > 1 else 1
        key = (window, attention_chunk, dtype, heads)
        mask = self.masks.get(key)
        if mask is None:
            mask = _additive(self._visible(window, attention_chunk)).to(dtype).unsqueeze(1)
            if heads > 1:
                mask = mask.repeat(1, 1, heads, 1)
            self.masks[key] = mask
        return mask

    def _visible(self, window: int | None, attention_chunk: int | None = None) -> torch.Tensor:
        """[num_seqs, query_len, keys] bool: query i of a piece sits at position first_position + i
        and sees keys [0, that position], or with a window only the last `window` of them, or with
        a chunk C only those from floor(position / C) * C on."""
        device = self.key_blocks.device
        num_keys = self.key_blocks.shape[1] * self.block_size
        visible = torch.zeros(len(self.pieces), self.query_len, num_keys, dtype=torch.bool, device=device)
        for index, (num_queries, first_position) in enumerate(self.pieces):
            seen = torch.ones(num_queries, first_position + num_queries, dtype=torch.bool, device=device)
            seen = seen.tril(first_position)
            if window is not None:
                seen = seen.triu(first_position - window + 1)
            if attention_chunk is not None:
                positions = torch.arange(first_position, first_position + num_queries, device=device)
                chunk_starts = positions // attention_chunk * attention_chunk
                seen &= torch.arange(first_position + num_queries, device=device)[None, :] >= chunk_starts[:, None]
            visible[index, :num_queries, : first_position + num_queries] = seen
            visible[index, num_queries:, 0] = True  # padding rows see one key: no all -inf row
        return visible

@dataclass(frozen=True, slots=True)
class _Piece:
    """Consecutive queries of one sequence: rows [row, row + num_queries) at positions from first_position."""

    row: int
    num_queries: int
    first_position: int
    seq: int  # index in block_tables

    @property
    def num_keys(self) -> int:  # keys up to the last query's position
        return self.first_position + self.num_queries


@dataclass(slots=True)
class _Plan:
    groups: list[_SequenceGroup]
    num_tokens: int


_last_plan: tuple[tuple, _Plan] | None = None  # (key of the inputs, plan), see _plan_for


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, v_head_dim] (MLA: v_head_dim may differ)
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached + new keys per sequence
    scale: float,
    *,
    window: int | None = None,  # sliding window: a query sees its own key and the window - 1 before it
    softcap: float | None = None,  # scores = softcap * tanh(scores / softcap), after the scale
    sinks: torch.Tensor | None = None,  # [num_heads]: each head's sink logit (no value) in the softmax
    attention_chunk: int | None = None,  # chunked attention: a query sees the keys of its own chunk of positions
) -> torch.Tensor:  # [num_tokens, num_heads, v_head_dim]
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads, v_head_dim = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    group_size = num_heads // num_kv_heads
    check_variants(num_heads, window, softcap, sinks, attention_chunk)
    plan = _plan_for(block_tables, query_start_loc, seq_lens, block_size)
    assert plan.num_tokens == num_tokens, (plan.num_tokens, num_tokens)
    explicit = softcap is not None or sinks is not None  # SDPA has neither
    out = torch.empty(num_tokens, num_heads, v_head_dim, dtype=q.dtype, device=q.device)
    for group in plan.groups:
        num_seqs, num_key_blocks = group.key_blocks.shape
        max_keys = num_key_blocks * block_size
        query_len = group.query_len
        # [seqs, query_len, kv_heads, group, dim] -> [seqs, kv_heads, group * query_len, dim]
        group_q = q[group.query_rows].view(num_seqs, query_len, num_kv_heads, group_size, head_dim)
        group_q = group_q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, group_size * query_len, head_dim)
        # whole blocks of each sequence: [seqs, max_keys, kv_heads, dim] -> [seqs, kv_heads, max_keys, dim]
        block_ids = group.key_blocks.view(-1)
        keys = k_cache.index_select(0, block_ids).view(num_seqs, max_keys, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, block_ids).view(num_seqs, max_keys, num_kv_heads, v_head_dim).transpose(1, 2)
        if explicit:
            mask = group.mask_for(group_size, torch.float32, window, attention_chunk)
            attended = _explicit_attention(group_q, keys, values, mask, scale, softcap, sinks, query_len)
        else:
            mask = group.mask_for(group_size, q.dtype, window, attention_chunk)
            attended = F.scaled_dot_product_attention(group_q, keys, values, attn_mask=mask, scale=scale)
        attended = attended.view(num_seqs, num_kv_heads, group_size, query_len, v_head_dim)
        attended = attended.permute(0, 3, 1, 2, 4).reshape(num_seqs * query_len, num_heads, v_head_dim)
        if group.real_queries is not None:
            attended = attended.index_select(0, group.real_queries)
        out[group.output_rows] = attended
    return out


def _explicit_attention(group_q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                        scale: float, softcap: float | None, sinks: torch.Tensor | None,
                        query_len: int) -> torch.Tensor:
    """SDPA's result with a soft-cap and sinks, in fp32: group_q [seqs, kv_heads, rows, dim] with
    rows = (head in group, query), keys/values [seqs, kv_heads, keys, dim], mask fp32 additive."""
    num_kv_heads, rows = group_q.shape[1], group_q.shape[2]
    scores = torch.matmul(group_q.float(), keys.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    if sinks is not None:
        # the sink of each row's head: rows are (head in group, query), heads kv_head * group + g
        row_sinks = sinks.float().view(num_kv_heads, -1, 1).expand(-1, -1, query_len).reshape(num_kv_heads, rows)
        sink_column = row_sinks.view(1, num_kv_heads, rows, 1).expand(scores.shape[0], -1, -1, -1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.float()).to(group_q.dtype)


def _plan_for(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_size: int) -> _Plan:
    # Layers of one step pass the very same tensors: reuse the plan while their identity and
    # version (bumped by any in-place write) are unchanged. The key holds the tensors, so
    # their ids cannot be reused by new tensors while the plan is cached. Inference-mode
    # tensors have no version counter: their plan is rebuilt on every call.
    global _last_plan
    tensors = (block_tables, query_start_loc, seq_lens)
    if any(tensor.is_inference() for tensor in tensors):
        return build_plan(block_tables, query_start_loc, seq_lens, block_size)
    key = (tensors, tuple(tensor._version for tensor in tensors), block_size)
    if _last_plan is not None and _same_key(_last_plan[0], key):
        return _last_plan[1]
    plan = build_plan(block_tables, query_start_loc, seq_lens, block_size)
    _last_plan = (key, plan)
    return plan


def _same_key(old: tuple, new: tuple) -> bool:
    return all(a is b for a, b in zip(old[0], new[0])) and old[1:] == new[1:]


MAX_PIECE_QUERIES = 512  # longer queries are cut into pieces, bounding each mask to 512 x keys
MAX_PADDING_RATIO = 1.25  # a group's padded query x key area over its real area, at most
MAX_GROUP_AREA = 1 << 22  # padded query x key elements of one group (multi-piece groups only)


def build_plan(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               block_size: int) -> _Plan:
    """Cut queries into pieces, group pieces of similar shape, and precompute each group's
    gather indices and mask."""
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    pieces = []
    for seq, seq_len in enumerate(lens):
        num_queries = starts[seq + 1] - starts[seq]
        assert num_queries <= seq_len, (seq, num_queries, seq_len)
        for offset in range(0, num_queries, MAX_PIECE_QUERIES):
            size = min(MAX_PIECE_QUERIES, num_queries - offset)
            pieces.append(_Piece(starts[seq] + offset, size, seq_len - num_queries + offset, seq))
    groups = [_build_group(members, block_tables, block_size) for members in _group_pieces(pieces)]
    return _Plan(groups, starts[-1])


def _group_pieces(pieces: list[_Piece]) -> list[list[_Piece]]:
    """Greedy: by decreasing (queries, keys), a piece joins the last group while padding stays small."""
    groups: list[list[_Piece]] = []
    for piece in sorted(pieces, key=lambda p: (p.num_queries, p.num_keys), reverse=True):
        if groups:
            members = groups[-1] + [piece]
            padded = len(members) * members[0].num_queries * max(p.num_keys for p in members)
            real = sum(p.num_queries * p.num_keys for p in members)
            if padded <= MAX_PADDING_RATIO * real and padded <= MAX_GROUP_AREA:
                groups[-1].append(piece)
                continue
        groups.append([piece])
    return [sorted(members, key=lambda p: p.row) for members in groups]  # in row order: often a slice


def _build_group(members: list[_Piece], block_tables: torch.Tensor, block_size: int) -> _SequenceGroup:
    device = block_tables.device
    query_len = max(p.num_queries for p in members)
    num_key_blocks = -(-max(p.num_keys for p in members) // block_size)
    query_rows: list[int] = []
    real_queries: list[int] = []
    output_rows: list[int] = []
    for index, piece in enumerate(members):
        query_rows.extend(range(piece.row, piece.row + piece.num_queries))
        query_rows.extend([piece.row] * (query_len - piece.num_queries))  # padding: any row, discarded
        real_queries.extend(range(index * query_len, index * query_len + piece.num_queries))
        output_rows.extend(range(piece.row, piece.row + piece.num_queries))
    has_padding = len(real_queries) < len(query_rows)
    return _SequenceGroup(
        query_rows=_rows(query_rows, device),
        output_rows=_rows(output_rows, device),
        real_queries=torch.tensor(real_queries, device=device) if has_padding else None,
        key_blocks=block_tables[[p.seq for p in members], :num_key_blocks].long(),
        query_len=query_len,
        block_size=block_size,
        pieces=tuple((p.num_queries, p.first_position) for p in members),
    )


def _rows(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    """Query rows as a slice when consecutive (a view, no gather), else an index tensor."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """Bool visibility -> additive fp32 mask (0 where visible, -inf elsewhere)."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))
