"""Unified paged attention in Triton: one launch for a varlen batch that mixes prefill
chunks (with or without a cached prefix) and decodes. Same signatures as
workers/kernels/torch_ref.py, so the model runner can swap backends.

Token layout of sequence s in the batch (positions are absolute within the sequence):

    keys in the pool:  [ cached prefix (context_len) | this step's queries (query_len) ]
                       0                    context_len                        seq_len
    query i (0-based) sits at position context_len + i and attends to keys [0, position].

    context_len = seq_lens[s] - query_len,  query_len = query_start_loc[s+1] - query_start_loc[s]

Work split (no host sync: the grid depends only on tensor shapes):
- Program (pid, kv_head) owns one q tile of one sequence: BLOCK_Q consecutive query tokens
  times the NUM_QUERIES_PER_KV query heads that share kv_head (GQA), packed into BLOCK_M rows
  as row = token_in_tile * NUM_QUERIES_PER_KV + head_in_group, so K/V is read once per group.
- Sequence s owns q tiles [query_start_loc[s] // BLOCK_Q + s, that of s+1), enough for
  cdiv(query_len, BLOCK_Q) tiles; a program finds its s by binary search over those starts
  and returns at once if its tile is past the sequence's queries. Grid:
  (num_tokens // BLOCK_Q + num_seqs, num_kv_heads).
- The KV loop walks the sequence's block table one page (BLOCK_SIZE keys) at a time, up to the
  last position any row of the tile may see; online softmax (exp2, fp32 running max/sum, fp32
  accumulator). Matmul inputs stay in the input dtype (fp16/bf16 tensor cores on GPU); fp32
  inputs use IEEE fp32 dots (no TF32) so fp32 results match the torch reference closely.

A layer's variants (workers/kernels/__init__.py), each a constexpr switch, so a plain layer
compiles to the kernel without them:
- USE_WINDOW: the query at p sees keys (p - window, p]; the KV loop starts at the page of the
  tile's first query's first visible key, so pages before every window of the tile are not read;
- USE_CHUNK: the query at p sees keys [p // chunk * chunk, p] (Llama 4's chunked attention); the
  KV loop starts at the page of the tile's first query's chunk (or window) start, as for a window;
- USE_SOFTCAP: s = c * tanh(s / c) on the scaled scores (done in log2 units: c log2(e) tanh(s / (c log2(e))));
- USE_SINKS: a row's running max starts at its head's sink (log2 units) and its sum at 1, so the
  sink enters the softmax's denominator and adds no value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.kernels import check_variants
from workers.kernels.torch_ref import allocate_kv_cache
from workers.kernels.triton_cache import write_kv_cache

__all__ = ["allocate_kv_cache", "paged_attention", "write_kv_cache"]

_LOG2E = 1.4426950408889634
_ATTN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _find_seq_idx(
    query_start_loc_ptr,  # [num_seqs + 1] int32
    q_tile,  # this program's global q tile index
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= q_tile (starts strictly increase)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh in fp32 from exp2, with no overflow: sign(x) (1 - e^(-2|x|)) / (1 + e^(-2|x|))."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens_ptr,  # [num_seqs] int32, cached + new tokens per sequence
    qk_scale,  # float: softmax scale * log2(e) (the softmax uses exp2)
    sinks_ptr,  # [num_heads] fp32 sink logits (USE_SINKS; any pointer otherwise)
    window,  # int: sliding window (USE_WINDOW)
    attention_chunk,  # int: chunk of positions a query attends within (USE_CHUNK)
    softcap_log2,  # float: soft-cap * log2(e) (USE_SOFTCAP)
    num_seqs,  # int
    stride_q_t,  # q.stride(0), elements
    stride_q_h,  # q.stride(1)
    stride_o_t,  # out.stride(0)
    stride_o_h,  # out.stride(1)
    stride_k_b,  # k_cache.stride(0)
    stride_k_t,  # k_cache.stride(1)
    stride_k_h,  # k_cache.stride(2)
    stride_v_b,  # v_cache.stride(0)
    stride_v_t,  # v_cache.stride(1)
    stride_v_h,  # v_cache.stride(2)
    stride_bt_s,  # block_tables.stride(0)
    NUM_QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    BLOCK_SIZE: tl.constexpr,  # keys per KV page (also the KV tile width)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,  # next power of two >= max(HEAD_DIM, 16)
    BLOCK_M: tl.constexpr,  # rows per program: BLOCK_Q tokens x NUM_QUERIES_PER_KV heads, padded
    BLOCK_Q: tl.constexpr,  # query tokens per program = BLOCK_M // NUM_QUERIES_PER_KV
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs; ignored for fp16/bf16
    USE_WINDOW: tl.constexpr,
    USE_CHUNK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq_idx = _find_seq_idx(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    query_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_tile_in_seq = q_tile - (q_start // BLOCK_Q + seq_idx)
    if q_tile_in_seq * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - query_len

    # Rows: (query token in tile, query head in the kv group).
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    offs_n = tl.arange(0, BLOCK_SIZE)
    q_in_seq = q_tile_in_seq * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # [BLOCK_M]
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV  # [BLOCK_M]
    row_valid = (offs_m // NUM_QUERIES_PER_KV < BLOCK_Q) & (q_in_seq < query_len)
    d_valid = offs_d < HEAD_DIM
    q_pos = context_len + q_in_seq  # [BLOCK_M] absolute position of each row's query
    token = (q_start + q_in_seq).to(tl.int64)

    q_offs = token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    if USE_SINKS:  # the sink as the first logit seen: max = sink, sum = e^0
        m_i = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)

    # The tile's last valid query sees keys [0, context_len + last_q]; pages past that are skipped,
    # and with a window or a chunk the pages before the first key its first query sees.
    last_q = tl.minimum((q_tile_in_seq + 1) * BLOCK_Q, query_len) - 1
    num_pages = tl.cdiv(context_len + last_q + 1, BLOCK_SIZE)
    first_pos = context_len + q_tile_in_seq * BLOCK_Q  # of the tile's first query
    first_key = 0
    if USE_WINDOW:
        first_key = tl.maximum(first_pos - window + 1, 0)
    if USE_CHUNK:
        first_key = tl.maximum(first_key, first_pos // attention_chunk * attention_chunk)
    first_page = first_key // BLOCK_SIZE
    for page in range(first_page, num_pages):
        block_id = tl.load(block_tables_ptr + seq_idx * stride_bt_s + page).to(tl.int64)
        k_pos = page * BLOCK_SIZE + offs_n  # [BLOCK_SIZE]
        k_valid = k_pos < seq_len

        # K^T tile [HEAD_DIM_PADDED, BLOCK_SIZE]; masked slots read 0 (the pool may hold NaN).
        kt_offs = block_id * stride_k_b + offs_n[None, :] * stride_k_t + kv_head * stride_k_h + offs_d[:, None]
        kt = tl.load(k_cache_ptr + kt_offs, mask=d_valid[:, None] & k_valid[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_SIZE] fp32
        if USE_SOFTCAP:
            s = softcap_log2 * _tanh(s / softcap_log2)
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        if USE_CHUNK:
            visible = visible & (k_pos[None, :] >= q_pos[:, None] // attention_chunk * attention_chunk)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # rows with no visible key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)

        v_offs = block_id * stride_v_b + offs_n[:, None] * stride_v_t + kv_head * stride_v_h + offs_d[None, :]
        v = tl.load(v_cache_ptr + v_offs, mask=k_valid[:, None] & d_valid[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def _choose_block_m(num_tokens: int, num_seqs: int, num_queries_per_kv: int) -> int:
    """Rows per program: the smallest tile tl.dot accepts (16) when the batch has no more
    queries than sequences (decodes), else 64. Only speed depends on it, never results."""
    rows = 16 if num_tokens == num_seqs else 64
    return max(rows, triton.next_power_of_2(num_queries_per_kv))


def _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> None:
    assert q.dim() == 3, f"q must be [T, H, D], got {tuple(q.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be [B, S, Hkv, D]"
    )
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert cache_head_dim == head_dim, f"cache head_dim {cache_head_dim} != q head_dim {head_dim}"
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, (
        f"block_size must be a power of two >= 16 (tl.dot tile), got {block_size}"
    )
    assert q.dtype in _ATTN_DTYPES, f"unsupported dtype {q.dtype}"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (
        f"dtypes differ: q {q.dtype} k_cache {k_cache.dtype} v_cache {v_cache.dtype}"
    )
    num_seqs = seq_lens.shape[0]
    assert seq_lens.dim() == 1 and seq_lens.dtype == torch.int32, f"seq_lens must be [S] int32, got {seq_lens.dtype}"
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32, (
        f"query_start_loc must be [{num_seqs + 1}] int32, got {tuple(query_start_loc.shape)} {query_start_loc.dtype}"
    )
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32, (
        f"block_tables must be [{num_seqs}, max_blocks] int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
    )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {t.stride()}"
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        assert t.is_contiguous(), f"{name} must be contiguous"
    for t in (k_cache, v_cache, block_tables, query_start_loc, seq_lens):
        assert t.device == q.device, f"all inputs must be on {q.device}, found one on {t.device}"


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    window: int | None = None,  # the layer's variants (workers/kernels/__init__.py); None: none
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads], on q's device
    attention_chunk: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], q's dtype
    """Causal GQA attention of each sequence's new queries over its paged K/V (which must
    already hold this step's keys: call write_kv_cache first)."""
    _check_inputs(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    check_variants(q.shape[1], window, softcap, sinks, attention_chunk)
    if sinks is not None:
        assert sinks.device == q.device and sinks.is_contiguous(), (sinks.device, sinks.stride())
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    num_queries_per_kv = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even when q is a view
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = _choose_block_m(num_tokens, num_seqs, num_queries_per_kv)
    block_q = block_m // num_queries_per_kv
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        float(scale) * _LOG2E,
        q if sinks is None else sinks, window or 0, attention_chunk or 0, (softcap or 1.0) * _LOG2E,
        num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        USE_WINDOW=window is not None,
        USE_CHUNK=attention_chunk is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
    )
    return out
