"""A quantized safetensors checkpoint (fp8, awq, gptq: workers/quant_formats.py) made ready for
the model: on CPU workers turned into the plain tensors of an unquantized checkpoint (the model is
then built exactly as for one, and every fast CPU path applies); on CUDA workers its quantized
linears kept packed for the Triton kernels.

    tensors = read_safetensors(model_dir, None)                  # as stored: fp8, int32, fp16 scales
    tensors = dequantize_checkpoint(config.quant_spec, tensors, torch.bfloat16)
    # every quantized linear {prefix} is now one {prefix}.weight [out, in] in bf16; every other
    # floating-point tensor (norms, biases, embeddings, unquantized layers) cast to bf16
    tensors = pack_checkpoint(config.quant_spec, tensors, torch.bfloat16, "cuda")
    # ... {prefix}.weight is an Int4Weight / Fp8Weight on the GPU (bias left as {prefix}.bias);
    # the model stacks q, k, v (gate, up) with their stacked(), and they multiply with
    # triton_quant.quant_linear (their linear())

Which layers are quantized is read off the tensor names: a prefix is a quantized linear when the
checkpoint holds one of its format's tensors ({prefix}.qweight, .qzeros, .scales, .g_idx for
awq/gptq; {prefix}.weight_scale, .input_scale, or a float8 {prefix}.weight for fp8) and the
config does not name it unquantized (QuantSpec.quantizes). Dequantizing is exact in fp32 (the
4-bit grid and e4m3 values times their fp16/fp32 scales), then rounded once to the model's dtype.
A missing or misshapen tensor fails in one line that names the layer and the tensor.
"""

from __future__ import annotations

import logging

import torch

from workers.quant_formats import QuantConfigError, QuantSpec, QuantWeight, load_quantized_linear, to_kernel_form

logger = logging.getLogger(__name__)


class QuantCheckpointError(ValueError):
    """A quantized layer's tensors are missing or misshapen; one line naming the layer and tensor."""


def quantized_prefixes(spec: QuantSpec, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The checkpoint's quantized linear layers (prefixes, without ".weight"), in name order."""
    suffixes = [name[1:] for name in spec.tensor_names("\0").values()]  # ".qweight", ".weight_scale", ...
    prefixes = set()
    for name, tensor in tensors.items():
        for suffix in suffixes:
            if not name.endswith(suffix):
                continue
            if suffix == ".weight" and tensor.dtype != torch.float8_e4m3fn:
                continue  # a plain weight: fp8 layers are told by their dtype (or their scales)
            prefix = name[: -len(suffix)]
            if spec.quantizes(prefix):
                prefixes.add(prefix)
    return sorted(prefixes)


def dequantize_checkpoint(spec: QuantSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype
                          ) -> dict[str, torch.Tensor]:
    """tensors as stored -> the same checkpoint unquantized, in dtype (see the module docstring)."""
    return _convert(spec, tensors, dtype, None)


def pack_checkpoint(spec: QuantSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                    device: torch.device | str) -> dict[str, torch.Tensor | QuantWeight]:
    """tensors as stored -> every quantized linear {prefix} as one {prefix}.weight in its
    kernel-ready form on device (an Int4Weight or Fp8Weight for triton_quant.quant_linear; its
    bias stays the plain {prefix}.bias), every other floating-point tensor cast to dtype."""
    return _convert(spec, tensors, dtype, torch.device(device))


def _convert(spec: QuantSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
             packed_on: torch.device | None) -> dict[str, torch.Tensor | QuantWeight]:
    if spec.method == "mxfp4":
        raise QuantCheckpointError("mxfp4 experts are dequantized by the gpt-oss expert reader (workers/moe.py)")
    out = dict(tensors)
    prefixes = quantized_prefixes(spec, tensors)
    for prefix in prefixes:
        try:
            if packed_on is None:
                weight = load_quantized_linear(spec, tensors, prefix, "cpu", torch.float32).to(dtype)
            else:
                weight = _kernel_weight(spec, tensors, prefix, packed_on, dtype)
        except QuantConfigError as error:
            raise QuantCheckpointError(f"{prefix}: {error}") from None
        for name in spec.tensor_names(prefix).values():
            out.pop(name, None)
        out[f"{prefix}.weight"] = weight
    for name, tensor in out.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.dtype != dtype:
            out[name] = tensor.to(dtype)
    if packed_on is None:
        logger.info("%s checkpoint: %d linear layers dequantized to %s at load (the dense weights are served)",
                    spec.label, len(prefixes), dtype)
    else:
        logger.info("%s checkpoint: %d linear layers kept packed on %s for the Triton kernels (%s activations)",
                    spec.label, len(prefixes), packed_on, dtype)
    return out


def _kernel_weight(spec: QuantSpec, tensors: dict[str, torch.Tensor], prefix: str, device: torch.device,
                   dtype: torch.dtype) -> QuantWeight:
    raw: dict[str, torch.Tensor | None] = {}
    for role, name in spec.tensor_names(prefix).items():
        if name not in tensors and not role.endswith("?"):
            raise QuantConfigError(f"{spec.source} checkpoint lacks {name} (a {role} of {prefix})")
        raw[role.rstrip("?")] = tensors.get(name)
    raw["bias"] = None  # the model adds {prefix}.bias itself (one bias for a fused product)
    return to_kernel_form(spec, raw, device, dtype)
