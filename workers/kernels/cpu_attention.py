"""Paged attention on CPU through our C kernel (csrc/paged_attention.c): the fast CPU path.

The same functions as workers/kernels/torch_ref.py (the oracle this kernel is tested against,
tests/workers/test_cpu_attention.py), plus the pool allocation, because the pool has its own
layout (csrc/paged_attention.c explains it): per block, the keys of each kv head transposed
(dims by keys, in pairs of dims for bf16) and then the values (keys by dims, in pairs of keys
for bf16), K and V adjacent. That turns both products into plain vector multiply-adds (bf16
pairs by vdpbf16ps) and a block into one sequential read. The kernel reads the pool in place
through the block table: nothing is gathered into fresh tensors.

    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
    out = paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)

fp32 and bf16 (q, pool and output in one dtype); head_dim up to 256, block_size up to 64 (even
for bf16), up to 256 query heads (see supports()). This launcher asserts the layouts the
kernel assumes.
"""

from __future__ import annotations

import ctypes

import torch

from workers.kernels.native import AttentionArgs, native_library

__all__ = ["allocate_kv_cache", "from_standard_layout", "paged_attention", "write_kv_cache"]

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64
MAX_HEADS = 256


def _pack(dtype: torch.dtype) -> int:
    """Elements stored together: pairs for bf16 (one vdpbf16ps operand), single for fp32."""
    return 2 if dtype == torch.bfloat16 else 1


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
    """Whether the kernel handles this model shape and dtype (else use the torch reference)."""
    return (
        dtype in _DTYPES and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE and num_heads <= MAX_HEADS
        and num_heads % num_kv_heads == 0 and head_dim % _pack(dtype) == 0 and block_size % _pack(dtype) == 0
    )


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One zeroed pool [num_blocks, 2, ...] whose two halves are the returned K and V views:
    K [num_blocks, num_kv_heads, head_dim / P, block_size, P], V [num_blocks, num_kv_heads,
    block_size / P, head_dim, P], P = 2 for bf16 and 1 for fp32 (zeros: see the runner)."""
    pack = _pack(dtype)
    pool = torch.zeros(num_blocks, 2, num_kv_heads * head_dim * block_size, dtype=dtype, device=device)
    k_cache = pool[:, 0].view(num_blocks, num_kv_heads, head_dim // pack, block_size, pack)
    v_cache = pool[:, 1].view(num_blocks, num_kv_heads, block_size // pack, head_dim, pack)
    return k_cache, v_cache


def from_standard_layout(k_standard: torch.Tensor, v_standard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of a pool in torch_ref's layout ([num_blocks, block_size, num_kv_heads, head_dim]
    each) in this backend's (for tests and tools)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_standard.shape
    pack = _pack(k_standard.dtype)
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, k_standard.dtype,
                                         k_standard.device)
    k_cache.copy_(k_standard.view(num_blocks, block_size, num_kv_heads, head_dim // pack, pack).permute(0, 2, 3, 1, 4))
    v_cache.copy_(v_standard.view(num_blocks, block_size // pack, pack, num_kv_heads, head_dim).permute(0, 3, 1, 4, 2))
    return k_cache, v_cache


def _layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(block_size, num_kv_heads, head_dim, block_stride) of a pool from allocate_kv_cache, checked."""
    num_blocks, num_kv_heads, dim_groups, block_size, pack = k_cache.shape
    head_dim = dim_groups * pack
    assert pack == _pack(k_cache.dtype) and k_cache.dtype == v_cache.dtype
    assert v_cache.shape == (num_blocks, num_kv_heads, block_size // pack, head_dim, pack), (k_cache.shape, v_cache.shape)
    block_stride = k_cache.stride(0)
    assert v_cache.stride(0) == block_stride and k_cache[0].is_contiguous() and v_cache[0].is_contiguous()
    return block_size, num_kv_heads, head_dim, block_stride


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], heads contiguous (rows may be strided)
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # from allocate_kv_cache
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    block_size, num_kv_heads, head_dim, block_stride = _layout(k_cache, v_cache)
    num_tokens = k.shape[0]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and k.dtype == k_cache.dtype
    assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == (num_tokens,)
    if num_tokens == 0:
        return
    status = native_library().rayllm_write_kv(
        k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_stride,
        slot_mapping.data_ptr(), num_tokens, num_kv_heads, head_dim, block_size, _DTYPES[k.dtype],
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"rayllm_write_kv failed with status {status}")


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # from allocate_kv_cache
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached + new keys per sequence
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads, pool_head_dim, block_stride = _layout(k_cache, v_cache)
    assert q.device.type == "cpu" and q.dtype == k_cache.dtype and q.stride(2) == 1 and pool_head_dim == head_dim
    assert supports(num_heads, num_kv_heads, head_dim, block_size, q.dtype)
    for index in (block_tables, query_start_loc, seq_lens):
        assert index.dtype == torch.int32 and index.is_contiguous(), (index.dtype, index.stride())
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape[0] == num_seqs + 1 and block_tables.shape[0] == num_seqs
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    if num_tokens == 0:
        return out
    args = AttentionArgs(
        q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(),
        num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_stride,
        scale, _DTYPES[q.dtype], torch.get_num_threads(),
    )
    status = native_library().rayllm_paged_attention(ctypes.byref(args))
    if status != 0:
        raise RuntimeError(f"rayllm_paged_attention failed with status {status}")
    return out
