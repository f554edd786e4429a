"""Quantized checkpoints: a config.json's `quantization_config` parsed into a small spec, the
tensors each format stores per linear layer, their kernel-ready form and a torch dequantize.

    spec = parse_quantization(raw["quantization_config"])        # QuantSpec, or QuantConfigError
    if spec.quantizes("model.layers.0.self_attn.q_proj"):
        weight = load_quantized_linear(spec, tensors, "model.layers.0.self_attn.q_proj", device)
    # CUDA: an Int4Weight / Fp8Weight / Mxfp4Weight for workers/kernels/triton_quant.quant_linear;
    # CPU: a dense [out, in] tensor, dequantized at load (one log line per format)

Formats (W = the dense [out, in] weight = [N, K]; g = k // group_size, the group of input k):

  fp8 (compressed-tensors float-quantized, fbgemm_fp8)     {prefix}.weight       float8_e4m3fn [N, K]
      W = weight * weight_scale[n]                          {prefix}.weight_scale fp32 [N, 1] (channel) or [1] (tensor)
      activations quantized to e4m3 per token at run time   {prefix}.input_scale  fp32 [1] (static activations only)
      (fbgemm: the per-token scale is capped at activation_scale_ub / 448)

  awq (AutoAWQ GEMM, "version": "gemm")                     {prefix}.qweight int32 [K, N / 8]
      W[n, k] = (q[k, n] - z[g, n]) * scales[g, n]          {prefix}.qzeros  int32 [K / group, N / 8]
      8 output columns per int32; column 8c + j sits in     {prefix}.scales  fp16  [K / group, N]
      nibble AWQ_NIBBLE[j] (packing order 0 2 4 6 1 3 5 7)

  gptq (AutoGPTQ / GPTQModel, 4 bits)                       {prefix}.qweight int32 [K / 8, N]
      W[n, k] = (q[k, n] - (z[g, n] + offset)) * s[g, n]    {prefix}.qzeros  int32 [K / group, N / 8]
      q: input rows 8r..8r+7 in nibbles 0..7 of row r;      {prefix}.scales  fp16  [K / group, N]
      z: output columns 8c..8c+7 in nibbles 0..7;           {prefix}.g_idx   int32 [K] (group of each input)
      offset 1 for checkpoint_format "gptq" (v1 stores zero - 1), 0 for "gptq_v2";
      desc_act (act-order): g = g_idx[k], any permutation of groups, read as is

  mxfp4 (gpt-oss experts; workers/mxfp4.py has the bit layout) {prefix}_blocks uint8 [(E,) N, K / 32, 16]
      W = e2m1(nibble) * 2 ** (scale - 127), 32 values a scale  {prefix}_scales uint8 [(E,) N, K / 32]
      prefix names the projection itself ("...mlp.experts.down_proj"), as gpt-oss does

Any other method, or a variant of these (8-bit GPTQ, AWQ without zero points or in another
version, FP8 blocks, int formats of compressed-tensors), fails with one line that names it and
lists what is supported.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from workers.mxfp4 import dequantize_mxfp4

logger = logging.getLogger(__name__)

SUPPORTED = ("compressed-tensors (fp8 weights, per-tensor or per-channel; fp8 dynamic per-token or static "
             "activations, or none)", "fbgemm_fp8", "awq (4-bit, gemm, zero_point)",
             "gptq (4-bit; gptq or gptq_v2 format)", "mxfp4 (gpt-oss)")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ int32 holds column AWQ_PACK_ORDER[i] of its 8
AWQ_NIBBLE = tuple(AWQ_PACK_ORDER.index(j) for j in range(8))  # column j -> its nibble: 0 4 1 5 2 6 3 7
FP8_MAX = 448.0  # largest float8_e4m3fn
FBGEMM_SCALE_UB = 1200.0  # fbgemm_fp8's default activation_scale_ub


class QuantConfigError(ValueError):
    """A quantization_config we cannot serve; the message is one line."""


@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's quantization_config says, reduced to what loading and the kernels need."""

    method: str  # "fp8" | "awq" | "gptq" | "mxfp4"
    source: str  # quant_method as the config spells it ("compressed-tensors", "fbgemm_fp8", ...)
    group_size: int | None = None  # awq/gptq: inputs per scale (None: the whole input row)
    zero_offset: int = 0  # gptq: added to every stored zero (1 for the v1 "gptq" format)
    desc_act: bool = False  # gptq: groups follow g_idx (act-order)
    weight_strategy: str | None = None  # fp8: "tensor" | "channel"
    activations: str | None = None  # fp8: "dynamic_token" | "static_tensor" | None (weights only)
    activation_scale_ub: float | None = None  # fp8: cap on a token's activation amax (fbgemm)
    skip: tuple[str, ...] = ()  # modules left unquantized (names, "re:" regexes, or * wildcards)

    @property
    def label(self) -> str:
        """A short name for /v1/models: "awq:4bit-g128", "gptq:4bit-g128-act-order",
        "compressed-tensors:fp8-channel", "fbgemm_fp8:fp8-channel", "mxfp4"."""
        if self.method in ("awq", "gptq"):
            group = f"g{self.group_size}" if self.group_size else "channel"
            return f"{self.method}:4bit-{group}" + ("-act-order" if self.desc_act else "")
        if self.method == "fp8":
            return f"{self.source}:fp8-{self.weight_strategy}"
        return self.method

    def quantizes(self, prefix: str) -> bool:
        """Whether the linear layer `prefix` (e.g. "model.layers.0.mlp.down_proj") is stored quantized."""
        return not any(_matches(prefix, pattern) for pattern in self.skip)

    def tensor_names(self, prefix: str) -> dict[str, str]:
        """role -> checkpoint tensor name of one linear layer; roles of optional tensors end in '?'."""
        if self.method == "fp8":
            names = {"weight": f"{prefix}.weight", "weight_scale": f"{prefix}.weight_scale"}
            if self.activations == "static_tensor":
                names["input_scale"] = f"{prefix}.input_scale"
            return names
        if self.method == "mxfp4":
            return {"blocks": f"{prefix}_blocks", "scales": f"{prefix}_scales"}
        names = {role: f"{prefix}.{role}" for role in ("qweight", "qzeros", "scales")}
        if self.method == "gptq":
            names["g_idx?"] = f"{prefix}.g_idx"
        return names


def _matches(prefix: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    if "*" in pattern:
        return fnmatch.fnmatchcase(prefix, pattern) or fnmatch.fnmatchcase(prefix, pattern + ".*")
    return prefix == pattern or prefix.endswith("." + pattern) or prefix.startswith(pattern + ".")


def _fail(method: object, why: str) -> QuantConfigError:
    return QuantConfigError(f"quantization {method!r}: {why}; supported: {'; '.join(SUPPORTED)}")


def parse_quantization(config: Mapping | None) -> QuantSpec | None:
    """config.json's quantization_config -> QuantSpec (None when absent). Raises QuantConfigError."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise _fail(config, "expected a JSON object")
    method = config.get("quant_method")
    skip = tuple(config.get("modules_to_not_convert") or ())
    if method == "compressed-tensors":
        return _parse_compressed_tensors(config)
    if method == "fbgemm_fp8":
        ub = float(config.get("activation_scale_ub") or FBGEMM_SCALE_UB)
        return QuantSpec("fp8", method, weight_strategy="channel", activations="dynamic_token",
                         activation_scale_ub=ub, skip=skip or ("lm_head",))
    if method in ("awq", "gptq"):
        return _parse_int4(method, config, skip)
    if method == "mxfp4":
        return QuantSpec("mxfp4", method, group_size=32, skip=skip)
    raise _fail(method, "not supported")


def _group_size(method: str, config: Mapping) -> int | None:
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))
    if group_size == -1:
        return None
    if group_size <= 0 or group_size % 8:
        raise _fail(method, f"group_size {group_size} is not -1 or a positive multiple of 8")
    return group_size


def _parse_int4(method: str, config: Mapping, skip: tuple[str, ...]) -> QuantSpec:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    if bits != 4:
        raise _fail(method, f"{bits}-bit weights are not supported (4-bit only)")
    group_size = _group_size(method, config)
    if method == "awq":
        version = str(config.get("version", config.get("format", "gemm"))).lower()
        if version != "gemm":
            raise _fail(method, f"version {version!r} is not supported (gemm only)")
        if not config.get("zero_point", True):
            raise _fail(method, "zero_point false is not supported (the gemm format stores zero points)")
        return QuantSpec("awq", method, group_size=group_size, skip=skip)
    if str(config.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise _fail(method, f"pack_dtype {config['pack_dtype']!r} is not supported (int32 words only)")
    fmt = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail(method, f"checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
    return QuantSpec("gptq", method, group_size=group_size, zero_offset=1 if fmt == "gptq" else 0,
                     desc_act=bool(config.get("desc_act", False)), skip=skip)


def _parse_compressed_tensors(config: Mapping) -> QuantSpec:
    method = "compressed-tensors"
    fmt = config.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _fail(method, f"format {fmt!r} is not supported (float-quantized fp8 only)")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        raise _fail(method, "no config_groups")
    schemes = {repr((g.get("weights"), g.get("input_activations"))) for g in groups}
    if len(schemes) > 1:
        raise _fail(method, f"{len(schemes)} different schemes across config_groups (one is supported)")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise _fail(method, f"weights of {weights.get('num_bits')} bits, type {weights.get('type')!r} "
                            "(8-bit float only)")
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel") or weights.get("dynamic"):
        raise _fail(method, f"weight strategy {strategy!r} is not supported (tensor or channel, static)")
    activations = None
    if inputs:
        if inputs.get("num_bits") != 8 or inputs.get("type") != "float":
            raise _fail(method, "input activations that are not 8-bit float")
        if inputs.get("dynamic") and inputs.get("strategy", "token") == "token":
            activations = "dynamic_token"
        elif not inputs.get("dynamic") and inputs.get("strategy", "tensor") == "tensor":
            activations = "static_tensor"
        else:
            raise _fail(method, f"input activations {inputs.get('strategy')!r} dynamic={inputs.get('dynamic')} "
                                "(dynamic per-token or static per-tensor only)")
    return QuantSpec("fp8", method, weight_strategy=strategy, activations=activations,
                     skip=tuple(config.get("ignore") or ()))


# ----------------------------------------------------------------------------- kernel-ready weights


class KernelReady:
    """The linear-weight interface (workers/linear.py, LinearWeight) of a kernel-ready weight: its
    products by workers/kernels/triton_quant.quant_linear (imported on first use: Triton)."""

    label: str  # its format, for messages

    @property
    def out_features(self) -> int:
        return self.shape[0]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
        from workers.kernels.triton_quant import quant_linear

        out = quant_linear(x, self)
        out = out if bias is None else out + bias
        return out if out_dtype is None else out.to(out_dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).float()

    def gated_product(self, x: torch.Tensor, bias: torch.Tensor | None, activation: str) -> None:
        return None

    def native_operand(self) -> None:  # no C kernel reads it
        return None

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)

    def for_kernels(self, logits: bool = False) -> KernelReady:
        return self

    def stacked(self, parts: list) -> KernelReady | None:
        """Weights of one input (self among them) stacked along their outputs (q, k, v -> qkv) in
        this format; None where they cannot share one (formats, groups, act-order orders or static
        input scales differ): the caller then dequantizes them."""
        if len(parts) == 1:
            return self
        if not all(type(p) is type(self) and p.bias is None for p in parts):
            return None
        return self._stacked(parts)

    def _stacked(self, parts: list) -> KernelReady | None:
        return None


@dataclass(frozen=True)
class Int4Weight(KernelReady):
    """An AWQ or GPTQ linear as its kernel reads it (layouts in the module docstring)."""

    layout: str  # "awq" | "gptq"
    qweight: torch.Tensor  # int32: awq [K, N / 8], gptq [K / 8, N]
    qzeros: torch.Tensor  # int32 [num_groups, N / 8]
    scales: torch.Tensor  # fp16/bf16/fp32 [num_groups, N]
    group_size: int  # inputs per group (K when the checkpoint says -1)
    zero_offset: int  # added to every stored zero
    g_idx: torch.Tensor | None  # int32 [K]: the group of each input (act-order only; None: k // group_size)
    bias: torch.Tensor | None  # [N]

    @property
    def shape(self) -> tuple[int, int]:  # (N, K), as the dense weight's
        n = self.scales.shape[1]
        return n, self.qweight.shape[0] * (1 if self.layout == "awq" else 8)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @property
    def label(self) -> str:
        return f"{self.layout} int4"

    def _stacked(self, parts: list[Int4Weight]) -> Int4Weight | None:
        first = parts[0]
        if not all((p.layout, p.group_size, p.zero_offset, p.scales.dtype) ==
                   (first.layout, first.group_size, first.zero_offset, first.scales.dtype)
                   and _same(p.g_idx, first.g_idx) for p in parts):
            return None
        return dataclasses.replace(first, qweight=torch.cat([p.qweight for p in parts], 1).contiguous(),
                                   qzeros=torch.cat([p.qzeros for p in parts], 1).contiguous(),
                                   scales=torch.cat([p.scales for p in parts], 1).contiguous())


@dataclass(frozen=True)
class Fp8Weight(KernelReady):
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # fp32 [N] (a per-tensor scale repeated)
    activations: str | None  # "dynamic_token" | "static_tensor" | None (x multiplies as it is)
    input_scale: torch.Tensor | None  # fp32 [1] (static_tensor)
    activation_scale_ub: float | None  # cap on a token's amax (dynamic_token)
    bias: torch.Tensor | None  # [N]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    label = "fp8"

    def _stacked(self, parts: list[Fp8Weight]) -> Fp8Weight | None:
        first = parts[0]
        if not all((p.activations, p.activation_scale_ub) == (first.activations, first.activation_scale_ub)
                   and _same(p.input_scale, first.input_scale) for p in parts):
            return None
        return dataclasses.replace(first, weight=torch.cat([p.weight for p in parts], 0).contiguous(),
                                   weight_scale=torch.cat([p.weight_scale for p in parts], 0).contiguous())


@dataclass(frozen=True)
class Mxfp4Weight(KernelReady):
    blocks: torch.Tensor  # uint8 [(E,) N, K / 2]: two e2m1 values a byte, the low nibble first
    scales: torch.Tensor  # uint8 [(E,) N, K / 32]: e8m0 exponents (bias 127)
    bias: torch.Tensor | None  # [(E,) N]

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[-2], self.blocks.shape[-1] * 2

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    label = "mxfp4"

    def expert(self, index: int) -> "Mxfp4Weight":
        """The [N, K] weight of one expert of a stacked [E, N, K] one (views)."""
        assert self.blocks.dim() == 3, "not a stack of experts"
        return Mxfp4Weight(self.blocks[index], self.scales[index], None if self.bias is None else self.bias[index])


QuantWeight = Int4Weight | Fp8Weight | Mxfp4Weight


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [..] -> int32 with `dim` 8x longer: nibble i of each word becomes element 8w + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [..., 8] (>> on int32 is arithmetic; the mask fixes it)
    nibbles = nibbles.movedim(-1, dim + 1 if dim >= 0 else dim)
    return nibbles.flatten(dim, dim + 1 if dim >= 0 else dim)


def unpack_int4(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [K, N], zeros [num_groups, N]) int32, zero_offset applied, columns in their true order."""
    zeros = _unpack_nibbles(weight.qzeros, 1)
    if weight.layout == "awq":
        order = list(AWQ_NIBBLE)  # column 8c + j is nibble AWQ_NIBBLE[j] of word c
        q = _unpack_nibbles(weight.qweight, 1)
        q = q.view(q.shape[0], -1, 8)[:, :, order].flatten(1)
        zeros = zeros.view(zeros.shape[0], -1, 8)[:, :, order].flatten(1)
    else:
        q = _unpack_nibbles(weight.qweight, 0)
    return q, zeros + weight.zero_offset


def dequantize(weight: QuantWeight | torch.Tensor) -> torch.Tensor:
    """The torch reference: any kernel-ready weight -> its dense [N, K] fp32 (a plain tensor: itself)."""
    if isinstance(weight, torch.Tensor):
        return weight.float()
    if isinstance(weight, Fp8Weight):
        return weight.weight.float() * weight.weight_scale.float()[:, None]
    if isinstance(weight, Mxfp4Weight):
        blocks = weight.blocks.view(*weight.blocks.shape[:-1], -1, 16)
        return dequantize_mxfp4(blocks, weight.scales, torch.float32)
    q, zeros = unpack_int4(weight)
    k = q.shape[0]
    groups = (torch.arange(k, device=q.device) // weight.group_size if weight.g_idx is None
              else weight.g_idx.long())
    return ((q - zeros[groups]).float() * weight.scales.float()[groups]).t().contiguous()


# ----------------------------------------------------------------------------- loading


def to_kernel_form(spec: QuantSpec, raw: Mapping[str, torch.Tensor | None], device: torch.device | str,
                   dtype: torch.dtype) -> QuantWeight:
    """A layer's checkpoint tensors (role -> tensor, roles of QuantSpec.tensor_names without '?',
    plus "bias") -> its kernel-ready weight on device. Checks shapes; one-line errors."""
    bias = raw.get("bias")
    bias = None if bias is None else bias.to(device=device, dtype=dtype)
    if spec.method == "fp8":
        weight, scale = raw["weight"], raw["weight_scale"].float().flatten()
        if weight.dtype != torch.float8_e4m3fn:
            raise QuantConfigError(f"fp8 weight is {weight.dtype}, expected torch.float8_e4m3fn")
        n = weight.shape[0]
        if scale.numel() not in (1, n):
            raise QuantConfigError(f"fp8 weight_scale has {scale.numel()} values for {n} output rows")
        input_scale = raw.get("input_scale")
        return Fp8Weight(weight.to(device).contiguous(), scale.expand(n).to(device).contiguous(), spec.activations,
                         None if input_scale is None else input_scale.float().flatten()[:1].to(device),
                         spec.activation_scale_ub, bias)
    if spec.method == "mxfp4":
        blocks, scales = raw["blocks"], raw["scales"]
        if blocks.shape[-1] == 16 and blocks.dim() == scales.dim() + 1:
            blocks = blocks.flatten(-2)  # [.., N, G, 16] -> [.., N, K / 2]
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape[:-1] \
                or blocks.shape[-1] != 16 * scales.shape[-1]:
            raise QuantConfigError(f"mxfp4 blocks {tuple(blocks.shape)} {blocks.dtype} do not fit scales "
                                   f"{tuple(scales.shape)} {scales.dtype}")
        return Mxfp4Weight(blocks.to(device).contiguous(), scales.to(device).contiguous(), bias)
    return _int4_kernel_form(spec, raw, device, dtype, bias)


def _int4_kernel_form(spec, raw, device, dtype, bias) -> Int4Weight:
    qweight, qzeros, scales = raw["qweight"], raw["qzeros"], raw["scales"]
    for name, tensor in (("qweight", qweight), ("qzeros", qzeros)):
        if tensor.dtype != torch.int32:
            raise QuantConfigError(f"{spec.method} {name} is {tensor.dtype}, expected torch.int32")
    num_groups, n = scales.shape
    k = qweight.shape[0] * (1 if spec.method == "awq" else 8)
    expected_qweight = (k, n // 8) if spec.method == "awq" else (k // 8, n)
    group_size = spec.group_size or k
    if tuple(qweight.shape) != expected_qweight or tuple(qzeros.shape) != (num_groups, n // 8) or n % 8 \
            or num_groups != -(-k // group_size):
        raise QuantConfigError(f"{spec.method} shapes do not fit: qweight {tuple(qweight.shape)}, qzeros "
                               f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} with group_size {group_size}")
    g_idx = raw.get("g_idx")
    if g_idx is not None:
        if g_idx.shape != (k,):
            raise QuantConfigError(f"gptq g_idx has shape {tuple(g_idx.shape)}, expected ({k},)")
        trivial = torch.equal(g_idx.long(), torch.arange(k, device=g_idx.device) // group_size)
        if trivial:
            g_idx = None
        elif not spec.desc_act:
            raise QuantConfigError("gptq g_idx is not k // group_size but desc_act is false")
        elif int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
            raise QuantConfigError(f"gptq g_idx holds groups outside [0, {num_groups})")
    return Int4Weight(spec.method, qweight.to(device).contiguous(), qzeros.to(device).contiguous(),
                      scales.to(device=device).contiguous(), group_size, spec.zero_offset,
                      None if g_idx is None else g_idx.to(device=device, dtype=torch.int32).contiguous(), bias)


_CPU_NOTED: set[str] = set()


def load_quantized_linear(spec: QuantSpec, tensors: Mapping[str, torch.Tensor], prefix: str,
                          device: torch.device | str, dtype: torch.dtype = torch.bfloat16
                          ) -> QuantWeight | torch.Tensor:
    """One linear layer of a quantized checkpoint: tensors maps checkpoint names to tensors (read,
    not removed); prefix is the layer's name without ".weight". On CUDA: its kernel-ready weight
    (workers/kernels/triton_quant.quant_linear multiplies by it). Elsewhere: the dense [out, in]
    weight in dtype, dequantized here (the CPU path has no quantized kernels; logged once per
    format). The bias, when the checkpoint has one ({prefix}.bias, mxfp4: {prefix}_bias), is
    inside the kernel-ready weight, and left to the caller on the dense path."""
    raw: dict[str, torch.Tensor | None] = {}
    for role, name in spec.tensor_names(prefix).items():
        optional = role.endswith("?")
        if name not in tensors and not optional:
            raise QuantConfigError(f"{spec.source} checkpoint lacks {name} (a {role} of {prefix})")
        raw[role.rstrip("?")] = tensors.get(name)
    raw["bias"] = tensors.get(f"{prefix}_bias" if spec.method == "mxfp4" else f"{prefix}.bias")
    on_cuda = torch.device(device).type == "cuda"
    weight = to_kernel_form(spec, raw, device if on_cuda else "cpu", dtype)
    if on_cuda:
        return weight
    if spec.source not in _CPU_NOTED:
        _CPU_NOTED.add(spec.source)
        logger.info("the CPU path dequantizes %s (%s) weights to %s at load", spec.source, spec.method, dtype)
    return dequantize(weight).to(device=device, dtype=dtype)
