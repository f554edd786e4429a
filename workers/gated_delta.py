"""The Gated DeltaNet mixer of Qwen3-Next's and Qwen3.5's linear_attention layers, over a fixed-size state per sequence.

Per layer, with x the normed hidden states [n, hidden] of one sequence (GatedDeltaTraits:
workers/families.py; Hk key heads, Hv value heads, each key head shared by Hv / Hk value heads):

    q, k, v, z, b, a = split(in_proj(x))                  q, k [n, Hk * dk]; v, z [n, Hv * dv]; b, a [n, Hv]
    q, k, v = split(silu(causal_conv(q ++ k ++ v)))       a depthwise convolution of width L over the tokens
    q, k    = l2norm(q) / sqrt(dk), l2norm(k)             per head, in fp32
    beta    = sigmoid(b)                                  how much of each token the state takes in
    g       = -exp(A_log) * softplus(a + dt_bias)         log of each token's decay of the state (<= 0)
    S_t     = exp(g_t) S_{t-1}                            per value head, S [dk, dv]:
    S_t    += k_t (beta_t (v_t - k_t^T S_t))^T            the delta rule: S learns v_t at key k_t
    o_t     = q_t^T S_t                                   [dv]
    y       = out_proj(rms_norm(o) * weight * silu(z))    per value head; the gated norm's weight is plain

The state of a sequence is the convolution's last L - 1 inputs [L - 1, conv_channels] (in the
activations' dtype) and S for every value head [Hv, dk, dv] (in fp32, as transformers keeps
it), rows of the layer's state pool (workers/recurrent.py).

A prompt's tokens run in chunks of CHUNK_SIZE (chunked_delta_rule): within a chunk the L
sequential updates are one unit lower-triangular solve and a few products (the UT transform of
DeltaNet), and only the chunks run in order. A step's one-token sequences run together through
one recurrent update (delta_rule_step_). A sequence cut anywhere into pieces gives the same
outputs (to rounding): the padding of a last partial chunk neither decays nor writes the state.

At load the checkpoint's projections are reordered and fused into one product, ours being [q of
every head, k, v, z, b, a], so that the split above is plain slicing. Qwen3-Next stores
in_proj_qkvz grouped by key head ([q, k, v, z] of each key head in turn) and in_proj_ba the same
way; Qwen3.5 stores in_proj_qkv (every q head, then k, then v: ours already), in_proj_z, in_proj_b
and in_proj_a (GatedDeltaTraits.projections). The maths after the product is the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.families import GatedDeltaTraits
from workers.recurrent import StatePool, causal_conv, decay_weights, unit_lower_solve

CHUNK_SIZE = 64  # tokens per chunk of chunked_delta_rule (transformers' and FLA's)
L2_NORM_EPS = 1e-6  # q and k are x / sqrt(sum(x^2) + eps) (FLA's l2norm)


@dataclass(slots=True)
class GatedDeltaWeights:
    """One linear_attention layer's tensors; in_proj and out in the linear backend's packed form."""

    in_proj: object  # [2 * key_dim + 2 * value_dim + 2 * Hv, hidden]: rows q, k, v, z, b, a (reordered at load)
    conv: torch.Tensor  # [conv_channels, conv_kernel]: the depthwise convolution over q ++ k ++ v
    dt_bias: torch.Tensor  # [Hv] fp32
    neg_decay_rate: torch.Tensor  # [Hv] fp32: -exp(A_log)
    norm: torch.Tensor  # [dv]: the gated RMSNorm's weight (x * w, not zero-centred)
    out: object  # [hidden, value_dim]


def read_gated_delta_weights(reader, prefix: str, traits: GatedDeltaTraits, hidden: int) -> GatedDeltaWeights:
    """The layer's tensors from the checkpoint (reader: model.py's _WeightReader; prefix:
    'model.layers.N.linear_attn.'), as transformers' Qwen3NextGatedDeltaNet or Qwen3_5GatedDeltaNet
    names them (traits.projections)."""
    t = traits

    def plain(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = reader.take(prefix + name, shape)
        if not isinstance(tensor, torch.Tensor):
            raise reader.error(f"{prefix + name} is a {tensor.label} weight; the Gated DeltaNet takes plain weights")
        return tensor

    if t.projections == "qkv_z_b_a":  # Qwen3.5: already in our order, one tensor after another
        in_proj = torch.cat([plain("in_proj_qkv.weight", (t.conv_channels, hidden)),
                             plain("in_proj_z.weight", (t.value_dim, hidden)),
                             plain("in_proj_b.weight", (t.num_v_heads, hidden)),
                             plain("in_proj_a.weight", (t.num_v_heads, hidden))], dim=0)
    else:
        in_proj = _ungrouped_in_proj(plain, t, hidden)
    conv = plain("conv1d.weight", (t.conv_channels, 1, t.conv_kernel))
    return GatedDeltaWeights(
        in_proj=reader.pack(in_proj.contiguous()),
        conv=conv.view(t.conv_channels, t.conv_kernel).contiguous(),
        dt_bias=plain("dt_bias", (t.num_v_heads,)).float(),
        neg_decay_rate=-plain("A_log", (t.num_v_heads,)).float().exp(),
        norm=plain("norm.weight", (t.head_v_dim,)),
        out=reader.pack(plain("out_proj.weight", (hidden, t.value_dim))),
    )


def _ungrouped_in_proj(plain, t: GatedDeltaTraits, hidden: int) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped by key head, as our rows q, k, v, z, b, a."""
    per_group = t.num_v_heads // t.num_k_heads  # value heads per key head
    group_rows = 2 * t.head_k_dim + 2 * per_group * t.head_v_dim
    qkvz = plain("in_proj_qkvz.weight", (t.num_k_heads * group_rows, hidden)).view(t.num_k_heads, group_rows, hidden)
    ba = plain("in_proj_ba.weight", (2 * t.num_v_heads, hidden)).view(t.num_k_heads, 2 * per_group, hidden)
    q, k, v, z = qkvz.split([t.head_k_dim, t.head_k_dim, per_group * t.head_v_dim, per_group * t.head_v_dim], dim=1)
    b, a = ba.split([per_group, per_group], dim=1)
    return torch.cat([part.reshape(-1, hidden) for part in (q, k, v, z, b, a)], dim=0)


class GatedDeltaMixer:
    """A linear_attention layer as a mixer of workers/recurrent.py (state_specs, prefill, decode)."""

    def __init__(self, weights: GatedDeltaWeights, traits: GatedDeltaTraits, eps: float,
                 scratch: DecodeScratch | None = None):
        self.weights = weights
        self.traits = traits
        self.eps = eps  # the gated RMSNorm's (the model's rms_norm_eps)
        self.scratch = scratch or DecodeScratch()  # shared by a model's Gated DeltaNet layers

    def state_specs(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """The convolution's last inputs [L - 1, conv_channels] and the fp32 matrices [Hv, dk, dv]."""
        t = self.traits
        return (((t.conv_kernel - 1, t.conv_channels), self.weights.conv.dtype),
                ((t.num_v_heads, t.head_k_dim, t.head_v_dim), torch.float32))

    def prefill(self, model, x: torch.Tensor, pool: StatePool, row: int) -> torch.Tensor:
        """One sequence's next n tokens x [n, hidden] -> [n, hidden]; pool[0][row], pool[1][row] updated."""
        conv_states, matrices = pool
        mixed, z, b, a = self._project(model, x)
        mixed = F.silu(causal_conv(mixed, self.weights.conv, None, conv_states[row]))
        q, k, v, g, beta = heads(mixed, b, a, self.weights, self.traits)
        if x.shape[0] == 1:
            out = delta_rule_step_(q, k, v, g, beta, matrices[row:row + 1])
        else:
            out = chunked_delta_rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.t(), beta.t(),
                                     matrices[row], solve=model.ops.unit_lower_solve).transpose(0, 1)
        gated = gated_rms_norm(out.to(z.dtype), z.view(out.shape), self.weights.norm, self.eps)
        return model.linear(gated.reshape(x.shape[0], self.traits.value_dim), self.weights.out, None)

    def decode(self, model, x: torch.Tensor, pool: StatePool, rows: torch.Tensor) -> torch.Tensor:
        """One token of each of s sequences x [s, hidden] -> [s, hidden]; their rows [s] of the pool
        updated, in the layer ops (our C kernels on CPU)."""
        conv_states, matrices = pool
        mixed, z, b, a = self._project(model, x)
        mixed = model.ops.conv_step(mixed, self.weights.conv, None, conv_states, rows, silu=True)
        gated = model.ops.gated_delta_step(mixed, z, b, a, self.weights, self.traits, self.eps, matrices, rows,
                                           self.scratch)
        return model.linear(gated, self.weights.out, None)

    def _project(self, model, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [n, hidden] -> q ++ k ++ v [n, conv_channels], z [n, value_dim], b [n, Hv], a [n, Hv]."""
        t = self.traits
        projected = model.linear(x, self.weights.in_proj, None)
        return projected.split([t.conv_channels, t.value_dim, t.num_v_heads, t.num_v_heads], dim=1)


def heads(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, w: GatedDeltaWeights,
          t: GatedDeltaTraits) -> tuple[torch.Tensor, ...]:
    """The convolved q ++ k ++ v [n, conv_channels] and b, a [n, Hv] -> fp32 q, k [n, Hv, dk]
    (normed, q scaled, each key head repeated for its value heads), v [n, Hv, dv], g, beta [n, Hv]."""
    n = mixed.shape[0]
    q, k, v = mixed.split([t.key_dim, t.key_dim, t.value_dim], dim=1)
    q = _l2_normed(q.float().view(n, t.num_k_heads, t.head_k_dim)) * t.head_k_dim**-0.5
    k = _l2_normed(k.float().view(n, t.num_k_heads, t.head_k_dim))
    per_group = t.num_v_heads // t.num_k_heads
    if per_group > 1:
        q, k = q.repeat_interleave(per_group, dim=1), k.repeat_interleave(per_group, dim=1)
    g = w.neg_decay_rate * F.softplus(a.float() + w.dt_bias)
    return q, k, v.float().view(n, t.num_v_heads, t.head_v_dim), g, torch.sigmoid(b).float()


def gated_step(mixed: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, w: GatedDeltaWeights,
               t: GatedDeltaTraits, eps: float, matrices: torch.Tensor, rows: torch.Tensor,
               scratch: DecodeScratch | None = None) -> torch.Tensor:
    """A decode step of s sequences from the conv's SiLU'd q ++ k ++ v [s, conv_channels] and
    in_proj's z [s, value_dim], b and a [s, Hv] to out_proj's input [s, value_dim] in z's dtype;
    matrices [num_rows, Hv, dk, dv] fp32 (matrices[rows] updated). The layer ops' reference
    (workers/layer_ops.py)."""
    q, k, v, g, beta = heads(mixed, b, a, w, t)
    states = (scratch or DecodeScratch()).rows(rows.shape[0], matrices)
    torch.index_select(matrices, 0, rows, out=states)
    out = delta_rule_step_(q, k, v, g, beta, states)
    matrices.index_copy_(0, rows, states)
    gated = gated_rms_norm(out.to(z.dtype), z.view(out.shape), w.norm, eps)
    return gated.reshape(rows.shape[0], t.value_dim)


def _l2_normed(x: torch.Tensor) -> torch.Tensor:
    """Each vector of x [..., d] over its own length: x / sqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_NORM_EPS)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] RMS-normed in fp32, back to its dtype, times weight [d], times silu(gate [..., d])
    in fp32; in x's dtype (transformers' Qwen3NextRMSNormGated)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def delta_rule_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor) -> torch.Tensor:
    """One token of each of s sequences through the gated delta rule, in fp32.

    q, k [s, H, dk]; v [s, H, dv]; g, beta [s, H]; states [s, H, dk, dv], updated in place.
    Returns o [s, H, dv]."""
    states.mul_(g.exp()[..., None, None])
    predicted = (k.unsqueeze(-2) @ states).squeeze(-2)  # [s, H, dv]: what the decayed state recalls at k
    correction = (v - predicted) * beta.unsqueeze(-1)
    states.addcmul_(k.unsqueeze(-1), correction.unsqueeze(-2))
    return (q.unsqueeze(-2) @ states).squeeze(-2)


class DecodeScratch:
    """Room for the states a decode gathers from the pool's rows, kept between steps and shared by a
    model's Gated DeltaNet layers (one runs at a time). A fresh [s, Hv, dk, dv] tensor per layer and
    step, and fresh ones for each update, cost page faults: at Qwen3-Next's shapes (32 heads of
    128 x 128, 16 sequences: 32 MB), 2 threads, one layer's delta rule took 54 ms that way against
    12.5 ms gathered here and updated in place (minima of 12 runs on a shared machine; 4 sequences:
    3.1 against 2.1 ms)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def rows(self, num_rows: int, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised [num_rows, *like.shape[1:]] view, like's dtype and device."""
        shape, b = like.shape[1:], self.buffer
        if b is None or b.shape[1:] != shape or b.dtype != like.dtype or b.device != like.device \
                or b.shape[0] < num_rows:
            self.buffer = b = torch.empty((num_rows, *shape), dtype=like.dtype, device=like.device)
        return b[:num_rows]


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk_size: int = CHUNK_SIZE, solve=unit_lower_solve) -> torch.Tensor:
    """One sequence's n tokens through the gated delta rule, chunk by chunk, in fp32; solve: the
    layer ops' unit_lower_solve (workers/recurrent.py's, torch's, by default).

    q, k [H, n, dk]; v [H, n, dv]; g, beta [H, n]; state [H, dk, dv], updated in place to the
    state after the n tokens. Returns o [H, n, dv], as n delta_rule_step_ calls would give.

    Within a chunk, with c_i the cumulative log decay from the chunk's start through token i and
    D_ij = exp(c_i - c_j) for j <= i (0 above), the delta rule's corrections u_i (what token i
    writes: S += k_i u_i^T) satisfy u_i = beta_i (v_i - exp(c_i) k_i^T S_0 - sum_{j<i} D_ij k_i.k_j u_j),
    a unit lower-triangular system T u = beta v - (beta exp(c) k) S_0 with T = I + strict(beta k k^T * D).
    So u = T^-1 (beta v) - T^-1 (beta exp(c) k) S_0, the two solves independent of S_0;
    o_i = exp(c_i) q_i^T S_0 + sum_{j<=i} D_ij q_i.k_j u_j; the state leaving the chunk is
    exp(c_L) S_0 + sum_j exp(c_L - c_j) k_j u_j^T."""
    num_heads, n, _ = k.shape
    # fewer tokens than a chunk are one chunk of their own length (to rounding, any chunking gives
    # the same result): at Qwen3.5's heads, 2 threads, a prefix hit's last 16 tokens took 1.7 ms so
    # and 6.9 padded to 64
    chunk_size = min(chunk_size, n)
    pad = (-n) % chunk_size  # padded tokens: g 0 (no decay), beta 0 and k 0 (no write)

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [H, n, ...] -> [H, num_chunks, chunk_size, ...]
        padded = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return padded.view(num_heads, -1, chunk_size, *x.shape[2:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    decay = g.cumsum(dim=-1)  # [H, C, L]: c_i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pairwise = decay_weights((decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")))  # D
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.mT) * pairwise  # its diagonal is ignored: T is unit triangular
    solved = solve(system, torch.cat([v * beta.unsqueeze(-1), k_beta * decay_weights(decay).unsqueeze(-1)], dim=-1))
    u_from_values, u_per_state = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    scores = (q @ k.mT) * pairwise  # [H, C, L, L]: the chunk's own tokens
    q_decayed = q * decay_weights(decay).unsqueeze(-1)
    k_to_end = k * decay_weights(decay[..., -1:] - decay).unsqueeze(-1)
    chunk_decay = decay_weights(decay[..., -1])  # [H, C]
    out = torch.empty_like(v)
    s = state.float()
    for c in range(q.shape[1]):
        u = u_from_values[:, c] - u_per_state[:, c] @ s
        out[:, c] = q_decayed[:, c] @ s + scores[:, c] @ u
        s = s * chunk_decay[:, c, None, None] + k_to_end[:, c].mT @ u
    state.copy_(s)
    return out.view(num_heads, -1, v.shape[-1])[:, :n]
