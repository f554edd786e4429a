"""Attention backends: modules exposing the same three functions.

    allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> (k_cache, v_cache)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None
    paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    *, window=None, softcap=None, sinks=None, attention_chunk=None) -> Tensor

The pool's layout is the backend's own (whatever allocate_kv_cache returns); the runner only
copies whole blocks (dimension 0) between requests.

The keyword arguments are a layer's attention variants, None meaning plain causal attention
(torch_ref's docstring has their exact maths): `window` (int) a sliding window, the query at
position p seeing keys (p - window, p] (Gemma 2/3, gpt-oss); `softcap` (float) the scores
soft-capped to softcap * tanh(scores / softcap) after the scale (Gemma 2); `sinks` (Tensor
[num_heads]) one more logit per head in the softmax's denominator, with no value (gpt-oss);
`attention_chunk` (int) C, chunked local attention, the query at position p seeing keys
[floor(p / C) * C, p] (Llama 4's RoPE layers: positions cut into chunks of C, each attending
within its own chunk only).

The model binds a step's metadata once (bind_attention) and calls write/attend per layer; a
backend may provide its own `bind(metadata, scale)` that does the per-step work (checks,
argument packing) once instead of 30 times.

- "cpu" (workers.kernels.cpu_attention): our C kernel over a pool laid out for it, read in
  place; the CPU default wherever it builds (a C compiler is present) and fits the model.
- "torch" (workers.kernels.torch_ref): plain torch; the oracle every other backend is tested
  against, and the CPU fallback.
- "triton" (workers.kernels.triton_attention): the GPU path, imported only when asked for, so
  CPU machines never need triton. It also runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

ATTENTION_BACKENDS = {
    "cpu": "workers.kernels.cpu_attention",
    "torch": "workers.kernels.torch_ref",
    "triton": "workers.kernels.triton_attention",
}


def resolve_attention_backend_name(name: str | None, device: str | torch.device, dtype: torch.dtype = torch.float32,
                                   heads: tuple[int, int, int] | None = None, block_size: int = 16) -> str:
    """The backend `name` stands for: None picks triton on CUDA; on CPU, our C kernel ("cpu")
    when it builds here and supports dtype and heads ((num_heads, num_kv_heads, head_dim);
    None: check the dtype only), else the torch reference."""
    if name is not None and name != "cpu":
        return name
    if name is None and torch.device(device).type == "cuda":
        return "triton"
    from workers.kernels import cpu_attention
    from workers.kernels.native import native_available, native_library

    shape = heads if heads is not None else (1, 1, 64)
    fits = torch.device(device).type == "cpu" and cpu_attention.supports(*shape, block_size, dtype)
    if name == "cpu":  # asked for: say why it cannot be had
        if not fits:
            raise ValueError(f"attention backend 'cpu' needs a CPU device, fp32 or bf16, head_dim <= "
                             f"{cpu_attention.MAX_HEAD_DIM} and block_size <= {cpu_attention.MAX_BLOCK_SIZE}; "
                             f"got {device}, {dtype}, heads {heads}, block_size {block_size}")
        native_library()  # NativeBuildError with the compiler's message
        return name
    return "cpu" if fits and native_available() else "torch"


def check_variants(num_heads: int, window: int | None, softcap: float | None, sinks: torch.Tensor | None,
                   attention_chunk: int | None = None) -> None:
    """Raises ValueError on an attention variant no backend takes (see the module docstring)."""
    for name, value in (("window", window), ("attention_chunk", attention_chunk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks must be [num_heads] = [{num_heads}], got {tuple(sinks.shape)}")


class StepAttention:
    """One step's attention, the same metadata for every layer (the default bind)."""

    def __init__(self, backend: ModuleType, metadata, scale: float) -> None:
        self.backend, self.metadata, self.scale = backend, metadata, scale

    def write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.backend.write_kv_cache(k, v, k_cache, v_cache, self.metadata.slot_mapping)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None,
               attention_chunk: int | None = None) -> torch.Tensor:
        m = self.metadata
        variants = {name: value for name, value in (("window", window), ("softcap", softcap), ("sinks", sinks),
                                                    ("attention_chunk", attention_chunk))
                    if value is not None}  # a plain layer calls the backend as before
        return self.backend.paged_attention(q, k_cache, v_cache, m.block_tables, m.query_start_loc, m.seq_lens,
                                            self.scale, **variants)


def bind_attention(backend: ModuleType, metadata, scale: float):
    """The step's attention (write / attend): the backend's own bind, else StepAttention."""
    bind = getattr(backend, "bind", None)
    return bind(metadata, scale) if bind is not None else StepAttention(backend, metadata, scale)


def get_attention_backend(name: str) -> ModuleType:
    """The attention module of a resolved backend name (see resolve_attention_backend_name)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(ATTENTION_BACKENDS)}")
    return importlib.import_module(ATTENTION_BACKENDS[name])
