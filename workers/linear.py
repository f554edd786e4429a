"""Linear layers: plain F.linear, or oneDNN with weights prepacked once at load (CPU).

On CPU, torch's F.linear calls MKL sgemm, which re-packs the weight matrix on every call;
for the small M of decode steps (one row per sequence) that packing, and the weight's trip
through memory, dominate. oneDNN with a weight reordered once into its blocked layout
(what torch.compile's CPU freezing uses) measured 2-3x faster here for every M from 1 to
2048, for fp32 (true fp32 arithmetic: |error| vs float64 ~1e-4, like MKL's order of
magnitude) and bf16.

    backend = select_linear_backend(None, device, dtype)   # "onednn" on CPU when available
    packed = backend.pack(weight)                          # [out, in] -> opaque tensor
    y = backend.linear(x, packed, bias)                    # x: [rows, in] -> [rows, out]

The packed tensor is opaque (not viewable, not picklable): keep the plain weight where it is
needed for something else, e.g. the embedding that lm_head is tied to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LINEAR_BACKENDS = ("torch", "onednn")


class TorchLinear:
    name = "torch"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.contiguous()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)


class OneDnnLinear:
    name = "onednn"

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def select_linear_backend(name: str | None, device: str | torch.device,
                          dtype: torch.dtype) -> TorchLinear | OneDnnLinear:
    """None picks oneDNN where available (CPU, fp32/bf16), torch elsewhere."""
    device = torch.device(device)
    if name is None:
        name = "onednn" if onednn_available(device, dtype) else "torch"
    if name == "torch":
        return TorchLinear()
    if name == "onednn":
        if not onednn_available(device, dtype):
            raise ValueError(f"linear backend 'onednn' needs a CPU device and fp32/bf16, got {device} {dtype}")
        return OneDnnLinear()
    raise ValueError(f"unknown linear backend {name!r}; expected one of {LINEAR_BACKENDS}")
