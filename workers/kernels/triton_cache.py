"""Triton kernel that writes this step's new K/V into the paged KV pool.

Pool layout (shared with workers/kernels/torch_ref.py and the attention kernel):

    k_cache[block_id, offset, kv_head, :]   holds the key of the token at slot
    slot = block_id * block_size + offset   (slot_mapping[t] for new token t)

One program per new token copies its [num_kv_heads, head_dim] tile of K and of V.
A negative slot (padding, e.g. a CUDA-graph batch padded to a captured size) writes
nothing; the scheduler never produces one.

Same signature as the torch reference, so the runner can swap backends.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _write_kv_cache_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64: block_id * block_size + offset
    stride_k_t,  # k.stride(0), elements
    stride_k_h,  # k.stride(1)
    stride_v_t,  # v.stride(0)
    stride_v_h,  # v.stride(1)
    stride_kc_b,  # k_cache.stride(0)
    stride_kc_t,  # k_cache.stride(1)
    stride_kc_h,  # k_cache.stride(2)
    stride_vc_b,  # v_cache.stride(0)
    stride_vc_t,  # v_cache.stride(1)
    stride_vc_h,  # v_cache.stride(2)
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block (page)
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    HEAD_DIM_PADDED: tl.constexpr,  # next power of two >= HEAD_DIM
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, NUM_KV_HEADS_PADDED)
    offs_d = tl.arange(0, HEAD_DIM_PADDED)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    kc_base = k_cache_ptr + block_id * stride_kc_b + offset * stride_kc_t
    vc_base = v_cache_ptr + block_id * stride_vc_b + offset * stride_vc_t
    tl.store(kc_base + offs_h[:, None] * stride_kc_h + offs_d[None, :], k, mask=mask)
    tl.store(vc_base + offs_h[:, None] * stride_vc_h + offs_d[None, :], v, mask=mask)


def write_kv_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Write k[t], v[t] into the pool at slot_mapping[t] (in place)."""
    assert k.dim() == 3 and k.shape == v.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, Hkv, D]"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (
        f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be [B, S, Hkv, D]"
    )
    num_tokens, num_kv_heads, head_dim = k.shape
    _, block_size, cache_kv_heads, cache_head_dim = k_cache.shape
    assert (cache_kv_heads, cache_head_dim) == (num_kv_heads, head_dim), (
        f"cache heads/dim {(cache_kv_heads, cache_head_dim)} != k heads/dim {(num_kv_heads, head_dim)}"
    )
    assert slot_mapping.shape == (num_tokens,), f"slot_mapping {tuple(slot_mapping.shape)} != ({num_tokens},)"
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    assert k_cache.dtype in _CACHE_DTYPES, f"unsupported cache dtype {k_cache.dtype}"
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, (
        f"dtypes differ: k {k.dtype} v {v.dtype} k_cache {k_cache.dtype} v_cache {v_cache.dtype}"
    )
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in head_dim, strides {t.stride()}"
        assert t.device == k_cache.device, f"{name} on {t.device}, cache on {k_cache.device}"
    assert slot_mapping.device == k_cache.device and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim),
    )
