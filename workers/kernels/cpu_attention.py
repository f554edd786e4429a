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
    step = bind(metadata, scale); step.write(k, v, k_cache, v_cache); out = step.attend(q, k_cache, v_cache)
    out = step.attend(q, k_cache, v_cache, window=4096, softcap=50.0, sinks=sinks)  # a layer's variants

The variants (workers/kernels/__init__.py) are per call: a window or an attention chunk makes
each task start at the block of its first query's first visible key (blocks before it are not
read); the soft-cap and the sinks (fp32 [num_heads], converted here if the layer keeps them in
another dtype) change only the scores and the softmax's start (csrc/paged_attention.c).

bind() checks and packs a step's metadata once for all its layers (per-layer Python cost
measured ~50 us per attention call before, of a ~10 us kernel at one decoding sequence).

fp32 and bf16 (q, pool and output in one dtype), and fp32 queries over an fp16 pool (half the
bytes to read per key; the kernel widens them as it loads them, and write_kv_cache rounds fp32
keys and values to half); head_dim up to 256, block_size up to 64 (even for bf16), up to 256
query heads (see supports()). This launcher asserts the layouts the kernel assumes.
"""

from __future__ import annotations

import ctypes

import torch

from workers.huge_pages import empty_huge
from workers.kernels import check_variants
from workers.kernels.cpu_isa import cpu_plan
from workers.kernels.native import DTYPE_CODES, KV_DTYPE_CODES, AttentionArgs, check_status, native_library

__all__ = ["allocate_kv_cache", "bind", "from_standard_layout", "paged_attention", "pool_layout", "write_kv_cache"]

MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 64
MAX_HEADS = 256
HALF_POOL_BLOCK_MULTIPLE = 16  # the AVX2 body reads a half pool's blocks 16 keys at a time; others: portable C


def _pack(dtype: torch.dtype) -> int:
    """Elements stored together: pairs for bf16 (one vdpbf16ps operand), single for fp32."""
    return 2 if dtype == torch.bfloat16 else 1


def pool_dtype_fits(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the kernel reads a pool of kv_dtype under queries of dtype: the same dtype, or an
    fp16 pool under fp32 queries."""
    return dtype in DTYPE_CODES and (kv_dtype == dtype or (dtype == torch.float32 and kv_dtype == torch.float16))


def supports(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
             kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernel handles this model shape, dtype and pool dtype (None: dtype) (else use
    the torch reference)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    return (
        pool_dtype_fits(dtype, kv_dtype) and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE
        and num_heads <= MAX_HEADS and num_heads % num_kv_heads == 0 and head_dim % _pack(kv_dtype) == 0
        and block_size % _pack(kv_dtype) == 0
    )


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One zeroed pool [num_blocks, 2, ...] whose two halves are the returned K and V views:
    K [num_blocks, num_kv_heads, head_dim / P, block_size, P], V [num_blocks, num_kv_heads,
    block_size / P, head_dim, P], P = 2 for bf16 and 1 for fp32 and fp16 (zeros: see the runner).
    dtype is the pool's (fp16 under an fp32 model: a half pool)."""
    pack = _pack(dtype)
    shape = (num_blocks, 2, num_kv_heads * head_dim * block_size)
    # On 2 MB pages where Linux offers them (workers/huge_pages.py): a step's blocks lie scattered
    # over the pool, and on 4 KB pages each is a TLB miss. bench.bench_attention --threads 2, 1 GB
    # of pools, alternating: bf16 6.3-8.8 -> 6.0-6.4 ms, fp32 10.4-10.7 -> 9.7-9.9. A pool above
    # glibc's mmap threshold (32 MB at most; a layer's share of the shipped 1 GB is 36 MB for
    # SmolLM2) is always fresh memory; a smaller one may reuse heap pages already touched.
    if torch.device(device).type == "cpu":
        pool = empty_huge(shape, dtype).zero_()
    else:
        pool = torch.zeros(shape, dtype=dtype, device=device)
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


def pool_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(block_size, num_kv_heads, head_dim, block_stride) of a pool from allocate_kv_cache, checked
    from shapes and strides alone (cheap: called per layer)."""
    num_blocks, num_kv_heads, dim_groups, block_size, pack = k_cache.shape
    head_dim = dim_groups * pack
    block_stride = k_cache.stride(0)
    assert pack == _pack(k_cache.dtype) and k_cache.dtype == v_cache.dtype
    assert v_cache.shape == (num_blocks, num_kv_heads, block_size // pack, head_dim, pack), (k_cache.shape, v_cache.shape)
    inner = (dim_groups * block_size * pack, block_size * pack, pack, 1)  # each block's part is contiguous
    assert k_cache.stride()[1:] == inner and v_cache.stride()[1:] == (block_size * head_dim, head_dim * pack, pack, 1)
    assert v_cache.stride(0) == block_stride
    return block_size, num_kv_heads, head_dim, block_stride


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], heads contiguous (rows may be strided)
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # from allocate_kv_cache
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset
) -> None:
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.shape == k.shape[:1]
    _write(k, v, k_cache, v_cache, slot_mapping.data_ptr())


def _write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: int) -> None:
    block_size, num_kv_heads, head_dim, block_stride = pool_layout(k_cache, v_cache)
    num_tokens = k.shape[0]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and k.dtype == v.dtype
    assert pool_dtype_fits(k.dtype, k_cache.dtype), (k.dtype, k_cache.dtype)
    assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim
    if num_tokens == 0:
        return
    check_status(native_library().rayllm_write_kv(
        k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_stride,
        slots, num_tokens, num_kv_heads, head_dim, block_size, DTYPE_CODES[k.dtype], KV_DTYPE_CODES[k_cache.dtype],
        torch.get_num_threads(),
    ), "rayllm_write_kv")


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # from allocate_kv_cache
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached + new keys per sequence
    scale: float,
    *,
    window: int | None = None,  # the layer's variants (workers/kernels/__init__.py); None: none
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
    attention_chunk: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    metadata = _Metadata(None, block_tables, query_start_loc, seq_lens)
    return CpuStepAttention(metadata, scale).attend(q, k_cache, v_cache, window=window, softcap=softcap, sinks=sinks,
                                                    attention_chunk=attention_chunk)


class _Metadata:
    """The AttentionMetadata fields this backend reads (for calls without the runner's object)."""

    def __init__(self, slot_mapping, block_tables, query_start_loc, seq_lens) -> None:
        self.slot_mapping, self.block_tables = slot_mapping, block_tables
        self.query_start_loc, self.seq_lens = query_start_loc, seq_lens


class CpuStepAttention:
    """One step's write/attend with the metadata checked and packed once (see bind)."""

    def __init__(self, metadata, scale: float) -> None:
        block_tables, query_start_loc, seq_lens = metadata.block_tables, metadata.query_start_loc, metadata.seq_lens
        for index in (block_tables, query_start_loc, seq_lens):
            assert index.dtype == torch.int32 and index.is_contiguous(), (index.dtype, index.stride())
        num_seqs = seq_lens.shape[0]
        assert query_start_loc.shape[0] == num_seqs + 1 and block_tables.shape[0] == num_seqs
        self.num_tokens = None if metadata.slot_mapping is None else metadata.slot_mapping.shape[0]
        self.slots = None
        if metadata.slot_mapping is not None:
            slot_mapping = metadata.slot_mapping
            assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            self.slots = slot_mapping.data_ptr()
        self.metadata = metadata  # keeps the tensors alive while their pointers are used
        self.args = AttentionArgs(
            block_tables=block_tables.data_ptr(), query_start_loc=query_start_loc.data_ptr(),
            seq_lens=seq_lens.data_ptr(), num_seqs=num_seqs, max_blocks_per_seq=block_tables.shape[1],
            scale=scale, num_threads=torch.get_num_threads(),
            tile_min_queries=cpu_plan().min_rows("attention"),  # prompts on AMX tiles (csrc/attention_amx.c)
        )
        self.function = native_library().rayllm_paged_attention

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        assert self.slots is not None and k.shape[0] == self.num_tokens
        _write(k, v, k_cache, v_cache, self.slots)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None,
               attention_chunk: int | None = None) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        block_size, num_kv_heads, pool_head_dim, block_stride = pool_layout(k_cache, v_cache)
        assert q.stride(2) == 1 and pool_head_dim == head_dim
        assert supports(num_heads, num_kv_heads, head_dim, block_size, q.dtype, k_cache.dtype)
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
        if num_tokens == 0:
            return out
        a = self.args
        a.q, a.out, a.k_cache, a.v_cache = q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()
        a.num_heads, a.num_kv_heads, a.head_dim, a.block_size = num_heads, num_kv_heads, head_dim, block_size
        a.q_stride_token, a.q_stride_head, a.out_stride_token, a.out_stride_head = (
            q.stride(0), q.stride(1), out.stride(0), out.stride(1))
        a.block_stride, a.dtype, a.kv_dtype = block_stride, DTYPE_CODES[q.dtype], KV_DTYPE_CODES[k_cache.dtype]
        if window is None and softcap is None and sinks is None and attention_chunk is None:
            a.window, a.attention_chunk, a.softcap, a.sinks = 0, 0, 0.0, None
        else:
            check_variants(num_heads, window, softcap, sinks, attention_chunk)
            sinks = fp32_sinks(sinks)  # kept alive by this frame while the kernel runs
            a.window, a.attention_chunk = window or 0, attention_chunk or 0
            a.softcap, a.sinks = softcap or 0.0, _ptr(sinks)
        check_status(self.function(ctypes.byref(a)), "rayllm_paged_attention")
        return out


def fp32_sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """Sinks as the kernel reads them: fp32, contiguous, on the CPU (the tensor itself when it is)."""
    return None if sinks is None else sinks.detach().to("cpu", torch.float32).contiguous()


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def bind(metadata, scale: float) -> CpuStepAttention:
    """A step's attention: metadata (the runner's AttentionMetadata) checked and packed once."""
    return CpuStepAttention(metadata, scale)
