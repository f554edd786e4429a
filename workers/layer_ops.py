"""The elementwise steps of a decoder layer and the lm_head, in two interchangeable forms.

    ops = select_layer_ops(None, device, dtype)   # "native" on CPU where the C kernels build, else "torch"
    residual, normed = ops.add_rms_norm(residual, delta, weight, eps)   # residual + delta, then RMSNorm
    ops.head_rms_norm(qkv, q_norm, k_norm, num_heads, num_kv_heads, eps)  # Qwen3's per-head norms, in place
    q, k, v = ops.rope(qkv, positions, rope, num_heads, num_kv_heads)   # q and k rotated; v as is
    act = ops.silu_mul(gate_up)

TorchOps is plain torch: the reference, and the path on GPUs. NativeOps calls our C kernels
(workers/kernels/csrc/layer_ops.c): each step is one pass over its rows instead of three to
eight torch ops (RMSNorm alone is five on CPU), residual adds happen in place, and rotary
embedding rotates q and k in place (writing k and v to the pool is the attention backend's:
its pool has its own layout). A profile of a batch-16 decode step (SmolLM2,
fp32, 1 thread) found about 25 torch dispatches per layer around the four GEMMs; these are 4.
(The matrix products, the lm_head included, are workers/linear.py's.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.kernels.native import DTYPE_CODES, check_status, native_available, native_library
from workers.rope import RotaryEmbedding, apply_rotary


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k and v views of fused qkv rows, [num_tokens, heads, head_dim] each (a layer without RoPE)."""
    num_tokens, q_width, kv_width = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_width].view(num_tokens, num_heads, head_dim),
            qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_dim),
            qkv[:, q_width + kv_width :].view(num_tokens, num_kv_heads, head_dim))


class TorchOps:
    name = "torch"

    def head_rms_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                      num_kv_heads: int, eps: float) -> None:
        """Each query and key head of the fused qkv rows RMS-normalized over its head_dim and
        times q_weight or k_weight ([head_dim]), IN PLACE (Qwen3's q_norm and k_norm)."""
        head_dim = q_weight.shape[0]
        q, k, _ = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        q.copy_(F.rms_norm(q, (head_dim,), q_weight, eps))
        k.copy_(F.rms_norm(k, (head_dim,), k_weight, eps))

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, rms_norm(residual + delta) * weight); delta None: no add."""
        if delta is not None:
            residual = residual + delta
        return residual, F.rms_norm(residual, weight.shape, weight, eps)

    def rope(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int,
             num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rotated q, rotated k, v), [num_tokens, heads, head_dim] each, from the fused qkv rows."""
        num_tokens, head_dim = qkv.shape[0], rope.cos.shape[1]
        cos, sin = rope.cos_sin(positions)
        # q and k are contiguous within each row of qkv: rotate both with one call
        qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
        qk = apply_rotary(qk, cos, sin)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
        return qk[:, :num_heads], qk[:, num_heads:], v

    split_qkv = staticmethod(split_qkv)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeOps:
    name = "native"

    def __init__(self) -> None:
        self.library = native_library()

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds delta into residual IN PLACE, and returns (residual, its RMSNorm times weight)."""
        assert residual.is_contiguous() and (delta is None or delta.is_contiguous()) and residual.dtype in DTYPE_CODES
        out = torch.empty_like(residual)
        check_status(self.library.rayllm_add_rms_norm(
            residual.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            residual.shape[0], residual.shape[1], eps, DTYPE_CODES[residual.dtype], torch.get_num_threads(),
        ), "rayllm_add_rms_norm")
        return residual, out

    def rope(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int,
             num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates q and k inside qkv IN PLACE; returns the q, k and v views."""
        num_tokens, head_dim = qkv.shape[0], rope.cos.shape[1]
        assert qkv.is_contiguous() and positions.dtype == torch.int64
        check_status(self.library.rayllm_rope(
            qkv.data_ptr(), positions.data_ptr(), rope.cos_f32.data_ptr(), rope.signed_sin_f32.data_ptr(),
            num_tokens, num_heads, num_kv_heads, head_dim, DTYPE_CODES[qkv.dtype], torch.get_num_threads(),
        ), "rayllm_rope")
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

    split_qkv = staticmethod(split_qkv)

    def head_rms_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                      num_kv_heads: int, eps: float) -> None:
        """TorchOps.head_rms_norm in one pass over the rows (csrc/layer_ops.c), in place."""
        assert qkv.is_contiguous() and qkv.dtype in DTYPE_CODES and q_weight.dtype == k_weight.dtype == qkv.dtype
        check_status(self.library.rayllm_head_rms_norm(
            qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), qkv.shape[0], num_heads, num_kv_heads,
            q_weight.shape[0], eps, DTYPE_CODES[qkv.dtype], torch.get_num_threads(),
        ), "rayllm_head_rms_norm")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        assert gate_up.is_contiguous()
        num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(num_rows, width, dtype=gate_up.dtype)
        check_status(self.library.rayllm_silu_mul(
            gate_up.data_ptr(), out.data_ptr(), num_rows, width, DTYPE_CODES[gate_up.dtype], torch.get_num_threads(),
        ), "rayllm_silu_mul")
        return out


LAYER_OPS = ("torch", "native")


def select_layer_ops(name: str | None, device: str | torch.device, dtype: torch.dtype) -> TorchOps | NativeOps:
    """None picks "native" on CPU (fp32/bf16) where the C kernels build, else "torch"."""
    device = torch.device(device)
    usable = device.type == "cpu" and dtype in DTYPE_CODES
    if name is None:
        name = "native" if usable and native_available() else "torch"
    if name == "torch":
        return TorchOps()
    if name == "native":
        if not usable:
            raise ValueError(f"layer ops 'native' need a CPU device and fp32/bf16, got {device} {dtype}")
        return NativeOps()
    raise ValueError(f"unknown layer ops {name!r}; expected one of {LAYER_OPS}")
