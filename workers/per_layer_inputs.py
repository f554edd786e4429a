"""Gemma 4's per-layer inputs: a small extra input per token and layer, gated into each layer's residual stream.

Once per step, from the token ids and their (scaled) embeddings e [T, hidden]:

    by_token = embed_per_layer[ids] * sqrt(size)                          [T, L, size]  (a second table)
    by_context = rms_norm(e @ projection.T * hidden ** -0.5) * norm       [T, L, size]  (normed per layer)
    inputs = (by_context + by_token) * 2 ** -0.5                          [T, L, size]

and in layer l, after the MLP's output has joined the residual stream h:

    h = h + rms_norm((act(h @ gate.T) * inputs[:, l]) @ up.T) * post_norm

(transformers' Gemma4TextModel.get_per_layer_inputs / project_per_layer_inputs and the tail of
Gemma4TextDecoderLayer.forward). `size` is hidden_size_per_layer_input; act is the MLP's activation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

INPUT_SCALE = 2.0**-0.5  # the two parts of an input are summed, then scaled by it


@dataclass(slots=True)
class PerLayerInputWeights:
    """The model's tensors that make every layer's input (one step computes them for all layers)."""

    embed: torch.Tensor  # [vocab_size_per_layer_input, num_layers * size]: by token id
    projection: object  # [num_layers * size, hidden] in the linear backend's form: from the embeddings
    norm: torch.Tensor  # [size]: RMSNorm weight of each layer's projected part


@dataclass(slots=True)
class PerLayerBranch:
    """One layer's tensors that gate its input into the residual stream."""

    gate: object  # [size, hidden] in the linear backend's form
    up: object  # [hidden, size] in the linear backend's form (the checkpoint's per_layer_projection)
    norm: torch.Tensor  # [hidden]: RMSNorm weight of the branch's output (post_per_layer_input_norm)


def read_per_layer_input_weights(reader, num_layers: int, size: int, hidden: int,
                                 vocab_size: int) -> PerLayerInputWeights:
    """The model-level tensors (model.embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm)."""
    return PerLayerInputWeights(
        embed=reader.take("model.embed_tokens_per_layer.weight", (vocab_size, num_layers * size)),
        projection=reader.pack(reader.take("model.per_layer_model_projection.weight", (num_layers * size, hidden))),
        norm=reader.take_norm("model.", "per_layer_projection_norm", size),
    )


def read_per_layer_branch(reader, prefix: str, size: int, hidden: int) -> PerLayerBranch:
    """Layer prefix's per_layer_input_gate, per_layer_projection and post_per_layer_input_norm."""
    return PerLayerBranch(
        gate=reader.pack(reader.take(prefix + "per_layer_input_gate.weight", (size, hidden))),
        up=reader.pack(reader.take(prefix + "per_layer_projection.weight", (hidden, size))),
        norm=reader.take_norm(prefix, "post_per_layer_input_norm"),
    )


def per_layer_inputs(weights: PerLayerInputWeights, input_ids: torch.Tensor, embedded: torch.Tensor,
                     linear: Callable, eps: float) -> torch.Tensor:
    """input_ids [T], embedded [T, hidden] (the scaled embeddings the layers start from) -> [T, L, size]."""
    num_tokens, hidden = embedded.shape
    size = weights.norm.shape[0]
    by_token = F.embedding(input_ids, weights.embed).view(num_tokens, -1, size) * size**0.5
    by_context = (linear(embedded, weights.projection, None) * hidden**-0.5).view(num_tokens, -1, size)
    by_context = F.rms_norm(by_context, (size,), weights.norm, eps)
    return (by_context + by_token) * INPUT_SCALE


def per_layer_branch(branch: PerLayerBranch, h: torch.Tensor, inputs: torch.Tensor, linear: Callable,
                     activation: str, eps: float) -> torch.Tensor:
    """h [T, hidden] (the residual stream after the layer's MLP), inputs [T, size] (the layer's) -> what the
    branch adds to h, [T, hidden]."""
    gate = linear(h, branch.gate, None)
    gated = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * inputs
    return F.rms_norm(linear(gated.contiguous(), branch.up, None), branch.norm.shape, branch.norm, eps)
