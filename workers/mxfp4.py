"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their experts' weights.

    # blocks [..., rows, G, 16] and scales [..., rows, G] uint8 -> [..., rows, G * 32] bf16
    weight = dequantize_mxfp4(blocks, scales, torch.bfloat16)

Each row is cut into groups of 32 values. A group is 16 bytes of `blocks` (uint8) holding two
FP4 E2M1 values each, the low nibble first (value 2i in bits 0-3, value 2i + 1 in bits 4-7), and
one byte of `scales` (uint8, E8M0): the whole group is multiplied by 2 ** (scale - 127).

    E2M1 nibble   s e e m       value = (-1)^s * {0, 0.5, 1, 1.5, 2, 3, 4, 6}[e e m]

gpt-oss's tensors are `{proj}_blocks` [E, out, in / 32, 16] and `{proj}_scales` [E, out, in / 32]
for gate_up_proj and down_proj, so a dequantized expert is [out, in], the layout we multiply by
(transformers transposes it to its own [E, in, out]). We dequantize once at load; serving the
4-bit weights as they are is for a kernel to come. Every value is exact in fp32 and bf16 (a
scale of 255, E8M0's NaN, reads as 2 ** 128: infinity, as transformers reads it too).
"""

from __future__ import annotations

import torch

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by nibble
GROUP_SIZE = 32  # values per scale
SCALE_BIAS = 127  # E8M0's exponent bias


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in dtype (module docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}: expected "
                         f"blocks [..., G, {GROUP_SIZE // 2}] and scales [..., G]")
    table = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]: low nibble, then high, per byte
    exponents = scales.to(torch.int32).sub_(SCALE_BIAS).unsqueeze(-1)
    return torch.ldexp(values, exponents).flatten(-2).to(dtype)
