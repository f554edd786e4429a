"""The elementwise steps of a decoder layer and the lm_head, in two interchangeable forms.

    ops = select_layer_ops(None, device, dtype)   # "native" on CPU where the C kernels build, else "torch"
    residual, normed = ops.add_rms_norm(residual, delta, weight, eps)   # residual + delta, then RMSNorm
    residual, residual = ops.add_rms_norm(residual, delta, None, eps)   # the add alone (OLMo 2's unnormed branches)
    normed = ops.rms_norm(delta, weight, eps)                             # a branch's output normed (may be in place)
    ops.head_rms_norm(qkv, q_norm, k_norm, num_heads, num_kv_heads, eps, whole)  # q/k norms, in place
    q, k, v = ops.rope(qkv, positions, rope, num_heads, num_kv_heads)   # q and k rotated; v as is
    act = ops.gated_mul(gate_up, "silu")                                  # or "gelu_tanh" (Gemma), or
    act = ops.gated_mul(gate_up, "swiglu_oai", alpha=1.702, limit=7.0)    # gpt-oss's experts' clamped SwiGLU
    y = ops.conv_step(x, weight, bias, states, rows, silu=True)           # recurrent layers' decode steps on
    y = ops.mamba2_step(...); y = ops.gated_delta_step(...)               # their state pools, and the delta
    u = ops.unit_lower_solve(system, rhs)                                 # rules' triangular solves

TorchOps is plain torch: the reference, and the path on GPUs. NativeOps calls our C kernels
(workers/kernels/csrc/layer_ops.c): each step is one pass over its rows instead of three to
eight torch ops (RMSNorm alone is five on CPU), residual adds happen in place, and rotary
embedding rotates q and k in place (writing k and v to the pool is the attention backend's:
its pool has its own layout). A profile of a batch-16 decode step (SmolLM2,
fp32, 1 thread) found about 25 torch dispatches per layer around the four GEMMs; these are 4.
(The matrix products, the lm_head included, are workers/linear.py's.)
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from workers import gated_delta
from workers.families import GatedDeltaTraits, Mamba2Traits
from workers.gated_delta import DecodeScratch, GatedDeltaWeights
from workers.kernels.native import (ACTIVATION_CODES, DTYPE_CODES, MAMBA2_NORM_MODES, GatedDeltaStepArgs,
                                    Mamba2StepArgs, check_status, native_available, native_library)
from workers.mamba2 import Mamba2Weights, gated_step
from workers.recurrent import causal_conv_step, unit_lower_solve
from workers.rope import RotaryEmbedding, apply_rotary

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's clamped SwiGLU, as its checkpoints use it


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
                      num_kv_heads: int, eps: float, whole: bool = False) -> None:
        """q and k of the fused qkv rows RMS-normalized and times q_weight and k_weight, IN PLACE:
        each head over its head_dim (Qwen3; weights [head_dim]), or whole: all of q and all of k
        (OLMo 2; weights [num_heads * head_dim] and [num_kv_heads * head_dim])."""
        q_width, k_width = q_weight.shape[0], k_weight.shape[0]
        head_dim = q_width // num_heads if whole else q_width
        q, k, _ = split_qkv(qkv, num_heads, num_kv_heads, head_dim)
        if whole:
            q, k = q.flatten(1), k.flatten(1)
        q.copy_(F.rms_norm(q, (q_width,), q_weight, eps))
        k.copy_(F.rms_norm(k, (k_width,), k_weight, eps))

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + delta, rms_norm(residual + delta) * weight); delta None: no add; weight
        None: no norm, (sum, sum)."""
        if delta is not None:
            residual = residual + delta
        return residual, residual if weight is None else F.rms_norm(residual, weight.shape, weight, eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, eps)

    def rope(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int,
             num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rotated q, rotated k, v), [num_tokens, heads, head_dim] each, from the fused qkv rows."""
        num_tokens, head_dim, rotary_dim = qkv.shape[0], rope.head_dim, rope.rotary_dim
        cos, sin = rope.cos_sin(positions)
        # q and k are contiguous within each row of qkv: rotate both with one call
        qk = qkv[:, : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_heads + num_kv_heads, head_dim)
        if rotary_dim == head_dim:
            qk = apply_rotary(qk, cos, sin)
        else:  # partial rotary: the rest of each head passes through
            qk = torch.cat((apply_rotary(qk[..., :rotary_dim], cos, sin), qk[..., rotary_dim:]), dim=-1)
        v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
        return qk[:, :num_heads], qk[:, num_heads:], v

    split_qkv = staticmethod(split_qkv)

    def gated_mul(self, gate_up: torch.Tensor, activation: str, alpha: float = SWIGLU_ALPHA,
                  limit: float = SWIGLU_LIMIT) -> torch.Tensor:
        """act(gate) * up of [gate, up] rows; act SiLU or GELU's tanh form; or gpt-oss's clamped
        SwiGLU ("swiglu_oai", transformers' GptOssExperts._apply_gate): gate clamped to at most
        limit, up to [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1)."""
        gate, up = gate_up.chunk(2, dim=-1)
        if activation == "swiglu_oai":
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            return gate * torch.sigmoid(gate * alpha) * (up + 1)
        return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up

    def conv_step(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor,
                  rows: torch.Tensor, silu: bool) -> torch.Tensor:
        """A recurrent layer's causal convolution for one token of each of s sequences
        (workers/recurrent.py's causal_conv_step; states[rows] move on by the token), SiLU'd if asked."""
        y = causal_conv_step(x, weight, bias, states, rows)
        return F.silu(y) if silu else y

    def unit_lower_solve(self, system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        """workers/recurrent.py's unit_lower_solve: the chunked delta rules' triangular solves."""
        return unit_lower_solve(system, rhs)

    def mamba2_step(self, xbc: torch.Tensor, dt: torch.Tensor, gate: torch.Tensor, weights: Mamba2Weights,
                    traits: Mamba2Traits, states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Mamba-2's decode step of s sequences from the conv's output to out_proj's input
        (workers/mamba2.py's gated_step, the reference)."""
        return gated_step(xbc, dt, gate, weights, traits, states, rows)

    def gated_delta_step(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                         weights: GatedDeltaWeights, traits: GatedDeltaTraits, eps: float, matrices: torch.Tensor,
                         rows: torch.Tensor, scratch: DecodeScratch | None = None) -> torch.Tensor:
        """The Gated DeltaNet's decode step of s sequences from the conv's output to out_proj's input
        (workers/gated_delta.py's gated_step, the reference)."""
        return gated_delta.gated_step(mixed, z, b, a, weights, traits, eps, matrices, rows, scratch)


class NativeOps:
    name = "native"

    def __init__(self) -> None:
        self.library = native_library()

    def add_rms_norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds delta into residual IN PLACE, and returns (residual, its RMSNorm times weight);
        weight None: (residual, residual), the add alone."""
        assert residual.is_contiguous() and (delta is None or delta.is_contiguous()) and residual.dtype in DTYPE_CODES
        out = residual if weight is None else torch.empty_like(residual)
        self._norm(residual, delta, weight, out, eps)
        return residual, out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x's RMSNorm times weight, IN PLACE (x is a branch's output, read by nothing else)."""
        assert x.is_contiguous() and x.dtype in DTYPE_CODES
        self._norm(x, None, weight, x, eps)
        return x

    def _norm(self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None,
              out: torch.Tensor, eps: float) -> None:
        check_status(self.library.rayllm_add_rms_norm(
            residual.data_ptr(), None if delta is None else delta.data_ptr(),
            None if weight is None else weight.data_ptr(), out.data_ptr(), residual.shape[0], residual.shape[1], eps,
            DTYPE_CODES[residual.dtype], torch.get_num_threads(),
        ), "rayllm_add_rms_norm")

    def rope(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, num_heads: int,
             num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotates q and k inside qkv IN PLACE; returns the q, k and v views."""
        num_tokens, head_dim = qkv.shape[0], rope.head_dim
        assert qkv.is_contiguous() and positions.dtype == torch.int64
        check_status(self.library.rayllm_rope(
            qkv.data_ptr(), positions.data_ptr(), rope.cos_f32.data_ptr(), rope.signed_sin_f32.data_ptr(),
            num_tokens, num_heads, num_kv_heads, head_dim, rope.rotary_dim, DTYPE_CODES[qkv.dtype],
            torch.get_num_threads(),
        ), "rayllm_rope")
        return split_qkv(qkv, num_heads, num_kv_heads, head_dim)

    split_qkv = staticmethod(split_qkv)

    def head_rms_norm(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_heads: int,
                      num_kv_heads: int, eps: float, whole: bool = False) -> None:
        """TorchOps.head_rms_norm in one pass over the rows (csrc/layer_ops.c), in place."""
        assert qkv.is_contiguous() and qkv.dtype in DTYPE_CODES and q_weight.dtype == k_weight.dtype == qkv.dtype
        head_dim = q_weight.shape[0] // num_heads if whole else q_weight.shape[0]
        check_status(self.library.rayllm_head_rms_norm(
            qkv.data_ptr(), q_weight.data_ptr(), k_weight.data_ptr(), qkv.shape[0], num_heads, num_kv_heads,
            head_dim, int(whole), eps, DTYPE_CODES[qkv.dtype], torch.get_num_threads(),
        ), "rayllm_head_rms_norm")

    def gated_mul(self, gate_up: torch.Tensor, activation: str, alpha: float = SWIGLU_ALPHA,
                  limit: float = SWIGLU_LIMIT) -> torch.Tensor:
        assert gate_up.is_contiguous()
        num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(num_rows, width, dtype=gate_up.dtype)
        check_status(self.library.rayllm_gated_mul(
            gate_up.data_ptr(), out.data_ptr(), num_rows, width, ACTIVATION_CODES[activation], alpha, limit,
            DTYPE_CODES[gate_up.dtype], torch.get_num_threads(),
        ), "rayllm_gated_mul")
        return out

    def conv_step(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor,
                  rows: torch.Tensor, silu: bool) -> torch.Tensor:
        """TorchOps.conv_step in one pass over each window (csrc/recurrent.c)."""
        num_seqs, channels = x.shape
        kernel = weight.shape[1]
        assert x.dtype == weight.dtype == states.dtype and x.dtype in DTYPE_CODES and x.stride(1) == 1
        assert weight.is_contiguous() and states.is_contiguous() and (bias is None or bias.dtype == x.dtype)
        assert rows.dtype == torch.int64 and rows.is_contiguous() and states.shape[1:] == (kernel - 1, channels)
        out = torch.empty(num_seqs, channels, dtype=x.dtype)
        check_status(self.library.rayllm_conv_step(
            x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
            states.data_ptr(), rows.data_ptr(), states.shape[0], out.data_ptr(), num_seqs, channels, kernel, int(silu),
            DTYPE_CODES[x.dtype], torch.get_num_threads(),
        ), "rayllm_conv_step")
        return out

    def mamba2_step(self, xbc: torch.Tensor, dt: torch.Tensor, gate: torch.Tensor, weights: Mamba2Weights,
                    traits: Mamba2Traits, states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """TorchOps.mamba2_step in two passes (csrc/recurrent.c): each state read, updated and
        reduced once, then each group's gate and norm; fp32 inside, out in xbc's dtype."""
        t, w = traits, weights
        num_seqs, dtype = xbc.shape[0], xbc.dtype
        assert dtype in DTYPE_CODES and dt.dtype == gate.dtype == dtype and (w.norm is None or w.norm.dtype == dtype)
        assert xbc.stride(1) == dt.stride(1) == gate.stride(1) == 1 and states.is_contiguous()
        assert states.dtype == torch.float32 and states.shape[1:] == (t.num_heads, t.head_dim, t.state_size)
        assert rows.dtype == torch.int64 and rows.is_contiguous()
        scratch = torch.empty(num_seqs, t.inner, dtype=torch.float32)
        out = torch.empty(num_seqs, t.inner, dtype=dtype)
        args = Mamba2StepArgs(
            xbc.data_ptr(), dt.data_ptr(), gate.data_ptr(), None if w.norm is None else w.norm.data_ptr(),
            w.dt_bias.data_ptr(), w.decay_rate.data_ptr(), w.skip.data_ptr(), states.data_ptr(),
            scratch.data_ptr(), out.data_ptr(), rows.data_ptr(), states.shape[0], num_seqs, t.num_heads, t.head_dim,
            t.state_size,
            t.num_groups, xbc.stride(0), dt.stride(0), gate.stride(0), t.time_step_min, t.time_step_max,
            t.norm_eps, MAMBA2_NORM_MODES[t.gated_norm], DTYPE_CODES[dtype], torch.get_num_threads())
        check_status(self.library.rayllm_mamba2_step(ctypes.byref(args)), "rayllm_mamba2_step")
        return out

    def unit_lower_solve(self, system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        """TorchOps.unit_lower_solve by forward substitution (csrc/recurrent.c), fp32."""
        assert system.dtype == rhs.dtype == torch.float32 and system.shape[-1] == system.shape[-2] == rhs.shape[-2]
        system = system.contiguous()
        out = rhs.contiguous().clone()
        length, width = rhs.shape[-2], rhs.shape[-1]
        batch = out.numel() // (length * width) if out.numel() else 0
        assert system.numel() == batch * length * length
        check_status(self.library.rayllm_unit_lower_solve(system.data_ptr(), out.data_ptr(), batch, length, width,
                                                          torch.get_num_threads()), "rayllm_unit_lower_solve")
        return out

    def gated_delta_step(self, mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                         weights: GatedDeltaWeights, traits: GatedDeltaTraits, eps: float, matrices: torch.Tensor,
                         rows: torch.Tensor, scratch: DecodeScratch | None = None) -> torch.Tensor:
        """TorchOps.gated_delta_step in two passes over each state (csrc/recurrent.c), fp32 inside,
        out in z's dtype; no scratch (the states are updated where they lie)."""
        t, w = traits, weights
        num_seqs, dtype = mixed.shape[0], mixed.dtype
        assert dtype in DTYPE_CODES and z.dtype == b.dtype == a.dtype == w.norm.dtype == dtype
        assert mixed.stride(1) == z.stride(1) == b.stride(1) == a.stride(1) == 1 and b.stride(0) == a.stride(0)
        assert matrices.dtype == torch.float32 and matrices.is_contiguous()
        assert matrices.shape[1:] == (t.num_v_heads, t.head_k_dim, t.head_v_dim)
        assert rows.dtype == torch.int64 and rows.is_contiguous()
        out = torch.empty(num_seqs, t.value_dim, dtype=dtype)
        args = GatedDeltaStepArgs(
            mixed.data_ptr(), z.data_ptr(), b.data_ptr(), a.data_ptr(), w.norm.data_ptr(), w.dt_bias.data_ptr(),
            w.neg_decay_rate.data_ptr(), matrices.data_ptr(), out.data_ptr(), rows.data_ptr(), matrices.shape[0],
            num_seqs, t.num_k_heads, t.num_v_heads, t.head_k_dim, t.head_v_dim, mixed.stride(0), z.stride(0),
            b.stride(0), eps, DTYPE_CODES[dtype], torch.get_num_threads())
        check_status(self.library.rayllm_gated_delta_step(ctypes.byref(args)), "rayllm_gated_delta_step")
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
