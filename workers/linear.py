"""Linear layers: plain F.linear, oneDNN with weights prepacked once at load, or that plus our
C kernels for the products they run faster (CPU).

    backend = select_linear_backend(None, device, dtype)   # "native" on CPU when the C kernels build
    weight = backend.pack(weight)                          # [out, in] -> the backend's form
    y = backend.linear(x, weight, bias)                    # x: [rows, in] -> [rows, out]
    logits = backend.logits(hidden, weight)                # the same product, fp32 out

A backend packs a plain [out, in] tensor into its own form. Any other weight carries its
products itself, through one interface (LinearWeight below): a GgufWeight (workers/gguf_weight.py),
a quantized checkpoint's kernel-ready weight (workers/quant_formats.py), and NativeLinear's
PanelWeight and DualWeight, which keep what their C kernels need. So the backends do not branch
on weight kinds.

Why each path (SmolLM2's shapes, weights streamed from memory, `bench.bench_linear`):
- F.linear calls MKL sgemm, which re-packs the weight on every call; oneDNN over a weight
  reordered once into its blocked layout measured 2-3x faster for every M from 1 to 2048,
  in fp32 (true fp32 arithmetic) and bf16.
- At one or two rows a step is bound by reading the weights, and oneDNN reads them at about
  half the machine's bandwidth. DualWeight keeps the plain row-major weight beside oneDNN's copy
  and sends products of at most GEMV_MAX_ROWS rows to rayllm_gemv (csrc/layer_ops.c), which
  streams each weight once: bf16, 1 thread, ms per step, 1 row 9.1 vs 17.2 oneDNN, 2 rows 12.2
  vs 22.5, 4 rows even. The plain copy costs memory (+212 MB per bf16 SmolLM2 worker).
- fp32 on AVX2 CPUs without AVX-512 (Zen 2/3, Intel before Ice Lake): PanelWeight, rayllm_panel_gemm
  over the weight packed once into panels of 16 output columns (layer_ops.c), up to PANEL_MAX_ROWS
  rows: 1 thread, 1 row 45.1 vs 53.4 GEMV, 16 rows 81.6 vs 109.2 oneDNN; from 2048 rows oneDNN
  is ahead (7451 vs 7754 ms), so it keeps those.
- bf16 on AVX512_BF16 CPUs (Zen 4, Sapphire Rapids on), and fp32 on AVX-512 CPUs: the panel GEMM
  of csrc/panel_avx512.c at every row count (bf16: vdpbf16ps over panels of 16 columns x k pairs;
  fp32: FMAs over the AVX2 layout, the same sums bit for bit). One summation order at every row
  count (a row's result is the same alone or in a batch), and our thread pool instead of OpenMP's.
  Products alone favour oneDNN from 256 rows on (bf16 by 2-4%, fp32 by up to 12%), but whole
  prefill steps through the C forward favour the panels (bf16, 8 prompts of 256 tokens, 2
  threads: 1251-1325 ms vs 1341-1396; fp32, one 256-token prompt: 301 / 330 ms vs 360 / 375),
  so no oneDNN copy of such a weight is kept (-269 MB per bf16 SmolLM2 worker, -540 MB fp32).
- bf16 products of many rows run on AMX tiles over the same panels (csrc/amx.c) where the CPU
  has them, from the row counts of workers/kernels/cpu_isa.py's table.

The packed tensor is opaque (not viewable, not picklable): keep the plain weight where it is
needed for something else, e.g. the embedding that lm_head is tied to.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from workers.gguf_weight import GgufWeight
from workers.huge_pages import HugeArena
from workers.kernels.cpu_isa import cpu_plan
from workers.kernels.native import (ACTIVATION_CODES, DTYPE_CODES, LINEAR_GEMV, LINEAR_PANELS, NativeOperand,
                                    check_status, native_available, native_library)
from workers.layer_ops import SWIGLU_ALPHA, SWIGLU_LIMIT
from workers.quant_formats import QuantWeight

LINEAR_BACKENDS = ("torch", "onednn", "native")
GEMV_MAX_ROWS = 2  # rows at most that take the C GEMV (see the measurements above)
PANEL_MAX_ROWS = 1024  # rows at most that take the fp32 panel GEMM on AVX2; more go to oneDNN
AVX512_PANEL_MAX_ROWS: int | None = None  # ... on AVX-512 CPUs (panel_avx512.c): every row count
BF16_PANEL_MAX_ROWS: int | None = None  # the bf16 panel GEMM (AVX512_BF16) takes every row count
PANEL_WIDTH = 16  # output columns per panel (layer_ops.c, panel_avx512.c)
TILE_K = 32  # input columns of an AMX tile (csrc/amx.c): a bf16 product on tiles needs a multiple of it


class LinearWeight(Protocol):
    """A weight that computes its own products: every weight kind but a plain tensor (GgufWeight,
    Int4Weight, Fp8Weight, Mxfp4Weight, PanelWeight, DualWeight)."""

    @property
    def out_features(self) -> int: ...

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [rows, in] @ W.T (+ bias) -> [rows, out] in out_dtype (None: x's dtype)."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The same product in fp32 (an lm_head's)."""

    def gated_product(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor | None:
        """act(gate) * up of x's gate_up product in one pass (the same bits as the product, then
        the ops' gated_mul); None where the weight has no such path."""

    def native_operand(self) -> NativeOperand | None:
        """How the C layer loop runs this weight's products; None where no C kernel takes it."""


Weight = torch.Tensor | LinearWeight


class TorchLinear:
    """F.linear over a plain tensor; any other weight (a GgufWeight, a quantized checkpoint's
    kernel-ready weight on CUDA) by its own products."""

    name = "torch"

    def pack(self, weight: torch.Tensor | GgufWeight | QuantWeight) -> Weight:
        return weight.contiguous() if isinstance(weight, torch.Tensor) else weight

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return F.linear(x, weight, bias)
        return weight.linear(x, bias)

    def logits(self, x: torch.Tensor, weight: Weight) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return self.linear(x, weight).float()
        return weight.logits(x)

    def gated_product(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None,
                      activation: str) -> torch.Tensor | None:
        """act(gate) * up of x's gate_up product in one pass, where the weight has such a product
        (LinearWeight.gated_product); None: compute the product, then the activation."""
        if isinstance(weight, torch.Tensor):
            return None
        return weight.gated_product(x, bias, activation)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) over oneDNN's reordered copy of W."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class OneDnnLinear(TorchLinear):
    name = "onednn"

    def pack(self, weight: torch.Tensor | GgufWeight) -> Weight:
        if not isinstance(weight, torch.Tensor):
            return weight
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return onednn_linear(x, weight, bias)
        return weight.linear(x, bias)


def gemv(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         out_dtype: torch.dtype) -> torch.Tensor:
    """x [rows, in] @ weight.T (+ bias) by rayllm_gemv over the plain row-major weight [out, in]."""
    x = x.contiguous()
    (num_rows, width), out_features = x.shape, weight.shape[0]
    assert weight.shape[1] == width and x.dtype == weight.dtype
    out = torch.empty(num_rows, out_features, dtype=out_dtype)
    check_status(library.rayllm_gemv(
        x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
        num_rows, out_features, width, DTYPE_CODES[x.dtype], DTYPE_CODES[out_dtype], torch.get_num_threads(),
    ), "rayllm_gemv")
    return out


@dataclass(frozen=True, slots=True)
class DualWeight:
    """NativeLinear's form of a weight no panel GEMM takes: the C GEMV for products of at most
    GEMV_MAX_ROWS rows, oneDNN's GEMM above."""

    plain: torch.Tensor  # [out, in] row-major: the C GEMV's operand
    packed: torch.Tensor  # oneDNN's reordered copy of the same weight
    library: ctypes.CDLL = field(repr=False, compare=False)  # the kernels (workers/kernels/native.py)

    @property
    def out_features(self) -> int:
        return self.plain.shape[0]

    @property
    def nbytes(self) -> int:  # what a product of a few rows reads
        return self.plain.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        rows = x.shape[0]
        if rows == 0:
            return x.new_empty(0, self.plain.shape[0], dtype=out_dtype)
        if rows <= GEMV_MAX_ROWS:
            return gemv(self.library, x, self.plain, bias, out_dtype)
        return onednn_linear(x, self.packed, bias).to(out_dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, None, torch.float32)

    def gated_product(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
        return None

    def native_operand(self) -> NativeOperand:
        return NativeOperand(self.plain, 0, LINEAR_GEMV, GEMV_MAX_ROWS)


@dataclass(frozen=True, slots=True)
class PanelWeight:
    """NativeLinear's form of a weight in panels of PANEL_WIDTH output columns: the panel GEMM for
    products of at most max_rows rows (bf16: on AMX tiles where cpu_plan says so), oneDNN's above."""

    panels: torch.Tensor  # fp32 [ceil(out / 16), in, 16] (layer_ops.c) or bf16 [ceil(out / 16), in / 2, 16, 2] (panel_avx512.c)
    packed: torch.Tensor | None  # oneDNN's reordered copy, for products of more rows than max_rows
    out_features: int
    max_rows: int | None  # rows at most that the panel GEMM takes (measured per dtype and vector width); None: all
    library: ctypes.CDLL = field(repr=False, compare=False)  # the kernels (workers/kernels/native.py)

    def takes(self, rows: int) -> bool:
        return within_row_limit(rows, self.max_rows)

    @property
    def nbytes(self) -> int:  # what a product of a few rows reads
        return self.panels.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        rows = x.shape[0]
        if rows == 0:  # nothing to multiply (and there may be no oneDNN copy to ask)
            return x.new_empty(0, self.out_features, dtype=out_dtype)
        if self.takes(rows):
            if self.panels.dtype == torch.bfloat16 and tiles_take_bf16(x, rows):
                return self.tile_gemm(x, bias, out_dtype)
            return self.panel_gemm(x, bias, out_dtype)
        return onednn_linear(x, self.packed, bias).to(out_dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, None, torch.float32)

    def native_operand(self) -> NativeOperand:
        return NativeOperand(self.panels, 0, LINEAR_PANELS, self.max_rows)

    def panel_gemm(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        x = x.contiguous()
        num_rows, width = x.shape
        assert x.dtype == self.panels.dtype
        out = torch.empty(num_rows, self.out_features, dtype=out_dtype)
        bias_ptr = None if bias is None else bias.data_ptr()
        if x.dtype == torch.float32:
            assert self.panels.shape[1] == width
            check_status(self.library.rayllm_panel_gemm(
                x.data_ptr(), self.panels.data_ptr(), bias_ptr, out.data_ptr(), num_rows, self.out_features, width,
                torch.get_num_threads(),
            ), "rayllm_panel_gemm")
        else:
            assert self.panels.shape[1] * 2 == width and (bias is None or bias.dtype == torch.bfloat16)
            check_status(self.library.rayllm_panel_gemm_bf16(
                x.data_ptr(), self.panels.data_ptr(), bias_ptr, out.data_ptr(), num_rows, self.out_features, width,
                DTYPE_CODES[out_dtype], torch.get_num_threads(),
            ), "rayllm_panel_gemm_bf16")
        return out

    def tile_gemm(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """The product on AMX tiles over the same bf16 panels (csrc/amx.c)."""
        x = x.contiguous()
        num_rows, width = x.shape
        assert x.dtype == torch.bfloat16 and self.panels.shape[1] * 2 == width
        assert bias is None or bias.dtype == torch.bfloat16
        out = torch.empty(num_rows, self.out_features, dtype=out_dtype)
        check_status(self.library.rayllm_amx_gemm_bf16(
            x.data_ptr(), self.panels.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
            num_rows, self.out_features, width, DTYPE_CODES[x.dtype], DTYPE_CODES[out_dtype], torch.get_num_threads(),
        ), "rayllm_amx_gemm_bf16")
        return out

    def gated_product(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor | None:
        """On AMX tiles (bf16 panels, from the table's rows): act(gate) * up of each 16 columns as
        they leave the tiles (csrc/amx.c), the gate_up product itself never written: the bits of
        the product in bf16 and then the ops' gated_mul. None where the tiles do not take it."""
        rows, width = x.shape
        if not (self.panels.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
                and self.out_features % (2 * PANEL_WIDTH) == 0 and tiles_take_bf16(x, rows)
                and activation in ACTIVATION_CODES and (bias is None or bias.dtype == torch.bfloat16)):
            return None
        x = x.contiguous()
        out = torch.empty(rows, self.out_features // 2, dtype=torch.bfloat16)
        check_status(self.library.rayllm_amx_gated_gemm_bf16(
            x.data_ptr(), self.panels.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), rows,
            self.out_features // 2, width, ACTIVATION_CODES[activation], SWIGLU_ALPHA, SWIGLU_LIMIT,
            torch.get_num_threads(),
        ), "rayllm_amx_gated_gemm_bf16")
        return out


def within_row_limit(rows: int, max_rows: int | None) -> bool:
    """At least one row, and at most max_rows (None: no limit)."""
    return rows > 0 and (max_rows is None or rows <= max_rows)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16]: panel p, step k holds weight[16p : 16p + 16, k] (zeros past out)."""
    out_features, in_features = weight.shape
    padding = -out_features % PANEL_WIDTH
    if padding:
        weight = torch.cat([weight, weight.new_zeros(padding, in_features)])
    return weight.reshape(-1, PANEL_WIDTH, in_features).transpose(1, 2).contiguous()


def pack_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16, in even -> [ceil(out / 16), in / 2, 16, 2]: panel p, pair j, lane c holds
    weight[16p + c, 2j] and weight[16p + c, 2j + 1] (zeros past out), one vdpbf16ps operand."""
    out_features, in_features = weight.shape
    assert in_features % 2 == 0 and weight.dtype == torch.bfloat16
    padding = -out_features % PANEL_WIDTH
    if padding:
        weight = torch.cat([weight, weight.new_zeros(padding, in_features)])
    return weight.reshape(-1, PANEL_WIDTH, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


class NativeLinear:
    """A plain weight packed as panels where a panel GEMM runs its dtype, else kept twice (DualWeight);
    a GGUF weight's blocks moved to 2 MB pages, which its kernels stream."""

    name = "native"

    def __init__(self) -> None:
        self.library = native_library()
        self.onednn = OneDnnLinear()
        self.has_panels = bool(self.library.rayllm_panel_gemm_available())  # fp32: AVX2 or AVX-512
        self.has_bf16_panels = bool(self.library.rayllm_panel_gemm_bf16_available())  # AVX512_BF16
        avx512 = self.library.rayllm_vector_width() == 16
        self.panel_max_rows = {torch.float32: AVX512_PANEL_MAX_ROWS if avx512 else PANEL_MAX_ROWS,
                               torch.bfloat16: BF16_PANEL_MAX_ROWS}
        self.arena = HugeArena()  # the panels and GGUF blocks, on 2 MB pages (workers/huge_pages.py)

    def pack(self, weight: torch.Tensor | GgufWeight) -> DualWeight | PanelWeight | GgufWeight:
        if not isinstance(weight, torch.Tensor):
            return weight.placed_in(self.arena)
        if self.has_panels and weight.dtype == torch.float32:
            return self._panel_weight(weight, pack_panels(weight))
        if self.has_bf16_panels and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
            return self._panel_weight(weight, pack_panels_bf16(weight))
        return DualWeight(weight.contiguous(), self.onednn.pack(weight), self.library)

    def _panel_weight(self, weight: torch.Tensor, panels: torch.Tensor) -> PanelWeight:
        """The panels, and oneDNN's copy only where more rows than the panels' limit go to it."""
        max_rows = self.panel_max_rows[weight.dtype]
        packed = None if max_rows is None else self.onednn.pack(weight)
        return PanelWeight(self.arena.copy(panels), packed, weight.shape[0], max_rows, self.library)

    def linear(self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        return weight.linear(x, bias)

    def logits(self, x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
        return weight.logits(x)

    def gated_product(self, x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None,
                      activation: str) -> torch.Tensor | None:
        return weight.gated_product(x, bias, activation)


def tiles_take_bf16(x: torch.Tensor, num_rows: int) -> bool:
    """A bf16 product of num_rows rows runs on AMX tiles (workers/kernels/cpu_isa.py's table); its
    width must be whole tiles of 32."""
    return x.shape[1] % TILE_K == 0 and cpu_plan().tiles_take("bf16", num_rows)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's prepacked linear runs here. Its bf16 path needs AVX512BW/VL/DQ or AVX-NE-CONVERT
    (torch refuses to reorder a bf16 weight otherwise, e.g. on an AVX2-only Zen 2/3): there bf16
    takes plain F.linear."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (dtype != torch.bfloat16 or _onednn_bf16_supported())
    )


def _onednn_bf16_supported() -> bool:
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def select_linear_backend(name: str | None, device: str | torch.device,
                          dtype: torch.dtype) -> TorchLinear | OneDnnLinear | NativeLinear:
    """None picks native (oneDNN + our GEMV) where both are available (CPU, fp32/bf16, a C
    compiler), else oneDNN on CPU, else torch."""
    device = torch.device(device)
    if name is None:
        if onednn_available(device, dtype):
            name = "native" if native_available() else "onednn"
        else:
            name = "torch"
    if name == "torch":
        return TorchLinear()
    if name in ("onednn", "native"):
        if not onednn_available(device, dtype):
            raise ValueError(f"linear backend {name!r} needs a CPU device and fp32/bf16 (bf16: a CPU with AVX512BW "
                             f"or AVX-NE-CONVERT), got {device} {dtype}")
        return OneDnnLinear() if name == "onednn" else NativeLinear()
    raise ValueError(f"unknown linear backend {name!r}; expected one of {LINEAR_BACKENDS}")
