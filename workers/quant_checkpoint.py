"""A quantized safetensors checkpoint (fp8, awq, gptq: workers/quant_formats.py) turned into the
plain tensors of an unquantized one, so that the model is built exactly as for an unquantized
checkpoint and every fast path applies.

    tensors = read_safetensors(model_dir, None)                  # as stored: fp8, int32, fp16 scales
    tensors = dequantize_checkpoint(config.quant_spec, tensors, torch.bfloat16)
    # every quantized linear {prefix} is now one {prefix}.weight [out, in] in bf16; every other
    # floating-point tensor (norms, biases, embeddings, unquantized layers) cast to bf16

Which layers are quantized is read off the tensor names: a prefix is a quantized linear when the
checkpoint holds one of its format's tensors ({prefix}.qweight, .qzeros, .scales, .g_idx for
awq/gptq; {prefix}.weight_scale, .input_scale, or a float8 {prefix}.weight for fp8) and the
config does not name it unquantized (QuantSpec.quantizes). Each is dequantized in fp32 by
load_quantized_linear (exact: the 4-bit grid and e4m3 values times their fp16/fp32 scales) and
then rounded once to the model's dtype. A missing or misshapen tensor fails in one line that
names the layer and the tensor.

The weights are dequantized on every device: the memory is that of the unquantized model. The
Triton kernels that multiply by the packed weights (workers/kernels/triton_quant.py) are not
wired into the model yet (docs/models.md, "Quantized checkpoints").
"""

from __future__ import annotations

import logging

import torch

from workers.quant_formats import QuantConfigError, QuantSpec, load_quantized_linear

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
    if spec.method == "mxfp4":
        raise QuantCheckpointError("mxfp4 experts are dequantized by the gpt-oss expert reader (workers/moe.py)")
    out = dict(tensors)
    prefixes = quantized_prefixes(spec, tensors)
    for prefix in prefixes:
        try:
            weight = load_quantized_linear(spec, tensors, prefix, "cpu", torch.float32)
        except QuantConfigError as error:
            raise QuantCheckpointError(f"{prefix}: {error}") from None
        for name in spec.tensor_names(prefix).values():
            out.pop(name, None)
        out[f"{prefix}.weight"] = weight.to(dtype)
    for name, tensor in out.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            out[name] = tensor.to(dtype)
    logger.info("%s checkpoint: %d linear layers dequantized to %s at load (the dense weights are served)",
                spec.label, len(prefixes), dtype)
    return out
