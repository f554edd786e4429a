"""Attention backends: modules exposing the same two functions.

    write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None
    paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale) -> Tensor

"torch" (workers.kernels.torch_ref) is the CPU path and the oracle; "triton"
(workers.kernels.triton_attention) is the GPU path, imported only when asked for, so CPU
machines never need triton. It also runs on CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

ATTENTION_BACKENDS = {
    "torch": "workers.kernels.torch_ref",
    "triton": "workers.kernels.triton_attention",
}


def resolve_attention_backend_name(name: str | None, device: str | torch.device) -> str:
    """The backend `name` stands for on `device`: None picks triton on CUDA and torch elsewhere."""
    if name is None:
        return "triton" if torch.device(device).type == "cuda" else "torch"
    return name


def get_attention_backend(name: str | None, device: str | torch.device) -> ModuleType:
    """The attention module for `name` (see resolve_attention_backend_name)."""
    name = resolve_attention_backend_name(name, device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; expected one of {sorted(ATTENTION_BACKENDS)}")
    return importlib.import_module(ATTENTION_BACKENDS[name])
