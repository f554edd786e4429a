"""Rotary position embeddings: inverse frequencies per scaling type, and a cos/sin cache.

Matches Hugging Face's Llama convention: the head is split in two halves (x1, x2) that rotate
together ("rotate_half"), not interleaved pairs. cos/sin are computed in fp32 once for every
position up to max_positions, then gathered by position each step. With partial rotary
(Phi-3) only the first rotary_dim values of a head rotate, in two halves of rotary_dim / 2.

longrope (Phi-3) keeps two sets of frequencies: short_factor's inside the original context and
long_factor's past it. transformers recomputes every position with long_factor once a sequence
grows past the original context; a paged cache cannot rewrite the keys it holds, so here each
position's row of the table is chosen by the position itself: rows below
original_max_position_embeddings use short_factor, rows from it on use long_factor. Inside the
original context the two agree exactly.

proportional (Gemma 4's full-attention layers) rotates the whole head in halves with the
default frequencies over head_dim, of which only the first int(proportion * head_dim) // 2 are
nonzero: the other pairs pass through unrotated.

yarn (gpt-oss) keeps the high frequencies (more than beta_fast rotations over the original
context), divides the low ones (fewer than beta_slow) by factor, and blends linearly by
dimension between the two; cos and sin are multiplied by its attention factor. One table for
every position, as transformers computes it.
"""

from __future__ import annotations

import math

import torch

from workers.config import ModelConfig, RopeScaling


def deinterleave(width: int) -> torch.Tensor:
    """Row order that turns interleaved RoPE pairs (0, 1), (2, 3), ... of width rows into the halves
    rotated here: the evens, then the odds."""
    return torch.cat((torch.arange(0, width, 2), torch.arange(1, width, 2)))


def deinterleave_rows(rows: torch.Tensor, num_heads: int, config: ModelConfig) -> torch.Tensor:
    """q or k projection rows [num_heads * head_dim, ...] (a weight, a bias or a LoRA B) of a family
    whose RoPE rotates interleaved pairs (2i, 2i + 1), reordered so that each pair becomes
    (i, i + rotary_dim / 2), the halves rotated here: with q and k reordered alike the scores are
    those of the interleaved rotation (FamilyTraits.rope_interleaved, ERNIE 4.5)."""
    head_dim, rotary_dim = config.head_dim, config.rotary_dim
    order = torch.cat((deinterleave(rotary_dim), torch.arange(rotary_dim, head_dim)))
    return rows.reshape(num_heads, head_dim, *rows.shape[1:])[:, order].reshape(rows.shape)


def inverse_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling, long: bool = False) -> torch.Tensor:
    """[rotary_dim // 2] fp32 inverse frequencies, as Hugging Face computes them for each rope_type
    (long: longrope's frequencies past the original context)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    if scaling.rope_type == "longrope":
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
        if factors.shape != exponents.shape:
            raise ValueError(f"longrope factors have {factors.numel()} entries for a rotary_dim of {rotary_dim}")
        return 1.0 / (factors * theta**exponents)
    if scaling.rope_type == "proportional":  # Gemma 4: the first frequencies of the whole head, the rest 0
        num_rotated = int(scaling.proportion * rotary_dim // 2)
        rotated = 1.0 / (theta ** exponents[:num_rotated])
        return torch.cat((rotated, torch.zeros(rotary_dim // 2 - num_rotated))) / scaling.factor
    inv_freq = 1.0 / (theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(theta**exponents, rotary_dim, theta, scaling)
    # "default", and "dynamic", which equals the default up to the original context length
    return inv_freq


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_frequencies(wavelength_bases: torch.Tensor, rotary_dim: int, theta: float,
                      scaling: RopeScaling) -> torch.Tensor:
    """wavelength_bases: theta ** (2i / rotary_dim), the default frequencies' inverses."""
    # the dimension at which a frequency makes num_rotations turns over the original context
    def correction_dim(num_rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation); 0: divided by factor (interpolation)
    return 1.0 / (scaling.factor * wavelength_bases) * (1 - keep) + 1.0 / wavelength_bases * keep


class RotaryEmbedding:
    """cos/sin tables [max_positions, rotary_dim] and their application to q and k."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: str | torch.device):
        scaling, rotary_dim = config.rope_scaling, config.rotary_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inverse_frequencies(rotary_dim, config.rope_theta, scaling)[None, :]
        if scaling.rope_type == "longrope" and max_positions > scaling.original_max_position_embeddings:
            start = scaling.original_max_position_embeddings
            long = inverse_frequencies(rotary_dim, config.rope_theta, scaling, long=True)
            freqs[start:] = positions[start:, None] * long[None, :]
        cos, sin = freqs.cos() * scaling.attention_factor, freqs.sin() * scaling.attention_factor
        self.max_positions = max_positions
        self.head_dim, self.rotary_dim = config.head_dim, rotary_dim
        self.cos_f32 = torch.cat((cos, cos), dim=-1).to(device=device)  # [max_positions, rotary_dim] fp32
        self.signed_sin_f32 = torch.cat((-sin, sin), dim=-1).to(device=device)  # [max_positions, rotary_dim] fp32
        self.cos = self.cos_f32.to(dtype)  # the same tables in the model's dtype (the torch path)
        self.signed_sin = self.signed_sin_f32.to(dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin, [num_tokens, 1, rotary_dim] each, ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim] -> rotated copy (x1*c - x2*s, x2*c + x1*s).

    Written as x * cos + swap_halves(x) * signed_sin: three kernels instead of seven."""
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1)
    return torch.addcmul(x * cos, swapped, signed_sin)
