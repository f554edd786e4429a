"""LFM2's short-convolution layer: a gated depthwise causal convolution over a few tokens.

Per layer, with x the normed hidden states of one sequence [n, hidden]:

    b, c, u = split(in_proj(x))                 each [n, hidden]
    y       = c * causal_conv(b * u)            kernel conv_L_cache tokens wide, per channel
    out     = out_proj(y)

A sequence's state is what the convolution still needs of its past: the last conv_L_cache - 1
values of b * u, [conv_L_cache - 1, hidden] (workers/recurrent.py keeps it per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.recurrent import StatePool, causal_conv


@dataclass(slots=True)
class ShortConv:
    """One short-convolution layer's weights (a mixer: workers/recurrent.py); products packed."""

    in_proj: object  # [3 * hidden, hidden]: b, c, u
    in_bias: torch.Tensor | None  # [3 * hidden]
    conv: torch.Tensor  # [hidden, width]
    conv_bias: torch.Tensor | None  # [hidden]
    out_proj: object  # [hidden, hidden]
    out_bias: torch.Tensor | None  # [hidden]
    state_dtype: torch.dtype

    def state_specs(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        hidden, width = self.conv.shape
        return (((width - 1, hidden), self.state_dtype),)

    def prefill(self, model, x: torch.Tensor, pool: StatePool, row: int) -> torch.Tensor:
        c, gated = self._gated_input(model, x)
        return self._out(model, c * causal_conv(gated, self.conv, self.conv_bias, pool[0][row]))

    def decode(self, model, x: torch.Tensor, pool: StatePool, rows: torch.Tensor) -> torch.Tensor:
        c, gated = self._gated_input(model, x)
        return self._out(model, c * model.ops.conv_step(gated, self.conv, self.conv_bias, pool[0], rows, silu=False))

    def _gated_input(self, model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, u = model.linear(x, self.in_proj, self.in_bias).chunk(3, dim=-1)
        return c, b * u

    def _out(self, model, y: torch.Tensor) -> torch.Tensor:
        return model.linear(y.contiguous(), self.out_proj, self.out_bias)


def read_short_conv(reader, prefix: str, hidden: int, width: int, bias: bool) -> ShortConv:
    """The layer at prefix (model.layers.N.conv.) through the model's weight reader (workers/model.py)."""
    conv = reader.take(prefix + "conv.weight", (hidden, 1, width))
    return ShortConv(
        in_proj=reader.pack(reader.take(prefix + "in_proj.weight", (3 * hidden, hidden))),
        in_bias=reader.take(prefix + "in_proj.bias", (3 * hidden,)) if bias else None,
        conv=conv[:, 0, :].contiguous(),
        conv_bias=reader.take(prefix + "conv.bias", (hidden,)) if bias else None,
        out_proj=reader.pack(reader.take_residual_branch(prefix + "out_proj.weight", (hidden, hidden))),
        out_bias=reader.take_residual_branch(prefix + "out_proj.bias", (hidden,)) if bias else None,
        state_dtype=conv.dtype,
    )
