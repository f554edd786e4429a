"""The Kimi Delta Attention (KDA) mixer of Kimi Linear's linear_attention layers, over a fixed-size state per sequence.

KDA is the Gated DeltaNet (workers/gated_delta.py) with a decay per key channel instead of per
head. Per layer, with x the normed hidden states [n, hidden] of one sequence (KdaTraits:
workers/families.py; H heads of width d for q, k and v alike):

    q, k, v = split(silu(causal_conv(q_proj(x) ++ k_proj(x) ++ v_proj(x))))    each [n, H * d]
    q, k    = l2norm(q) / sqrt(d), l2norm(k)               per head, in fp32
    beta    = sigmoid(b_proj(x))                           [n, H]
    g       = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)   [n, H, d]: log decay of each key channel (<= 0)
    S_t     = diag(exp(g_t)) S_{t-1}                       per head, S [d, d]: row i decays by exp(g_t[i])
    S_t    += k_t (beta_t (v_t - k_t^T S_t))^T             the delta rule
    o_t     = q_t^T S_t                                    [d]
    y       = o_proj(rms_norm(o) * weight * sigmoid(g_b(g_a(x))))   per head; the gate's activation is a sigmoid

The state of a sequence is the convolution's last L - 1 inputs [L - 1, 3 * H * d] (in the
activations' dtype) and S for every head [H, d, d] (in fp32), rows of the layer's state pool
(workers/recurrent.py). A prompt's tokens run in chunks (chunked_kda); a step's one-token
sequences run together through one recurrent update (kda_step_).

At load q_proj, k_proj, v_proj, f_a_proj, g_a_proj and b_proj (all read x) are fused into one
product; f_b_proj and g_b_proj stay two small products of their low-rank parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.families import KdaTraits
from workers.gated_delta import CHUNK_SIZE, DecodeScratch, _l2_normed
from workers.recurrent import StatePool, causal_conv, decay_weights, unit_lower_solve


@dataclass(slots=True)
class KdaWeights:
    """One KDA layer's tensors; products in the linear backend's packed form."""

    in_proj: object  # [3 * H * d + 2 * d + H, hidden]: rows q, k, v, f_a, g_a, b
    conv: torch.Tensor  # [3 * H * d, conv_kernel]: the depthwise convolution over q ++ k ++ v
    f_b: object  # [H * d, d]: the decay's low-rank up product
    g_b: object  # [H * d, d]: the output gate's low-rank up product
    dt_bias: torch.Tensor  # [H, d] fp32
    neg_decay_rate: torch.Tensor  # [H, 1] fp32: -exp(A_log)
    norm: torch.Tensor  # [d]: the gated RMSNorm's weight
    out: object  # [hidden, H * d]


def read_kda_weights(reader, prefix: str, traits: KdaTraits, hidden: int) -> KdaWeights:
    """The layer's tensors from the checkpoint (reader: model.py's _WeightReader; prefix:
    'model.layers.N.self_attn.'), as transformers' KimiLinearDeltaAttention names them or as Moonshot's
    checkpoints do (f_a_proj, f_b_proj, A_log, dt_bias without forget_gate.; q_conv1d, k_conv1d, v_conv1d)."""
    t = traits
    width = t.num_heads * t.head_dim

    def plain(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.startswith("forget_gate.") and prefix + name not in reader.tensors:
            name = name.removeprefix("forget_gate.")  # Moonshot's names: self_attn.f_a_proj, .A_log, ...
        tensor = reader.take(prefix + name, shape)
        if not isinstance(tensor, torch.Tensor):
            raise reader.error(f"{prefix + name} is a {tensor.label} weight; KDA takes plain weights")
        return tensor

    rows = [plain("q_proj.weight", (width, hidden)), plain("k_proj.weight", (width, hidden)),
            plain("v_proj.weight", (width, hidden)), plain("forget_gate.f_a_proj.weight", (t.head_dim, hidden)),
            plain("g_a_proj.weight", (t.head_dim, hidden)), plain("b_proj.weight", (t.num_heads, hidden))]
    if prefix + "conv1d.weight" in reader.tensors:  # transformers' layout: one convolution over q ++ k ++ v
        conv = plain("conv1d.weight", (t.conv_channels, 1, t.conv_kernel))
    else:  # Moonshot's: one per projection
        conv = torch.cat([plain(f"{part}_conv1d.weight", (width, 1, t.conv_kernel)) for part in "qkv"], dim=0)
    return KdaWeights(
        in_proj=reader.pack(torch.cat(rows, dim=0).contiguous()),
        conv=conv.view(t.conv_channels, t.conv_kernel).contiguous(),
        f_b=reader.pack(plain("forget_gate.f_b_proj.weight", (width, t.head_dim))),
        g_b=reader.pack(plain("g_b_proj.weight", (width, t.head_dim))),
        dt_bias=plain("forget_gate.dt_bias", (width,)).float().view(t.num_heads, t.head_dim),
        neg_decay_rate=-plain("forget_gate.A_log", (1, 1, t.num_heads, 1)).float().exp().view(t.num_heads, 1),
        norm=plain("o_norm.weight", (t.head_dim,)),
        out=reader.pack(plain("o_proj.weight", (hidden, width))),
    )


class KdaMixer:
    """A KDA layer as a mixer of workers/recurrent.py (state_specs, prefill, decode)."""

    def __init__(self, weights: KdaWeights, traits: KdaTraits, eps: float, scratch: DecodeScratch | None = None):
        self.weights = weights
        self.traits = traits
        self.eps = eps  # the gated RMSNorm's (the model's rms_norm_eps)
        self.scratch = scratch or DecodeScratch()  # shared by a model's recurrent layers

    def state_specs(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """The convolution's last inputs [L - 1, 3 * H * d] and the fp32 matrices [H, d, d]."""
        t = self.traits
        return (((t.conv_kernel - 1, t.conv_channels), self.weights.conv.dtype),
                ((t.num_heads, t.head_dim, t.head_dim), torch.float32))

    def prefill(self, model, x: torch.Tensor, pool: StatePool, row: int) -> torch.Tensor:
        """One sequence's next n tokens x [n, hidden] -> [n, hidden]; pool[0][row], pool[1][row] updated."""
        conv_states, matrices = pool
        mixed, f, gate, b = self._project(model, x)
        mixed = F.silu(causal_conv(mixed, self.weights.conv, None, conv_states[row]))
        q, k, v, g, beta = self._heads(model, mixed, f, b)
        if x.shape[0] == 1:
            out = kda_step_(q, k, v, g, beta, matrices[row:row + 1])
        else:
            out = chunked_kda(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.transpose(0, 1), beta.t(),
                              matrices[row], solve=model.ops.unit_lower_solve).transpose(0, 1)
        return self._output(model, out, gate)

    def decode(self, model, x: torch.Tensor, pool: StatePool, rows: torch.Tensor) -> torch.Tensor:
        """One token of each of s sequences x [s, hidden] -> [s, hidden]; their rows [s] of the pool updated."""
        conv_states, matrices = pool
        mixed, f, gate, b = self._project(model, x)
        mixed = model.ops.conv_step(mixed, self.weights.conv, None, conv_states, rows, silu=True)
        q, k, v, g, beta = self._heads(model, mixed, f, b)
        states = self.scratch.rows(rows.shape[0], matrices)
        torch.index_select(matrices, 0, rows, out=states)
        out = kda_step_(q, k, v, g, beta, states)
        matrices.index_copy_(0, rows, states)
        return self._output(model, out, gate)

    def _project(self, model, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [n, hidden] -> q ++ k ++ v [n, 3 * H * d], f_a(x), g_a(x) [n, d], b [n, H]."""
        t = self.traits
        projected = model.linear(x, self.weights.in_proj, None)
        return projected.split([t.conv_channels, t.head_dim, t.head_dim, t.num_heads], dim=1)

    def _heads(self, model, mixed: torch.Tensor, f: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The convolved q ++ k ++ v [n, 3 * H * d], f_a(x) [n, d] and b [n, H] -> fp32 q, k, v [n, H, d]
        (q, k normed, q scaled), g [n, H, d] and beta [n, H]."""
        t, n = self.traits, mixed.shape[0]
        q, k, v = (part.float().view(n, t.num_heads, t.head_dim) for part in mixed.chunk(3, dim=1))
        q = _l2_normed(q) * t.head_dim**-0.5
        k = _l2_normed(k)
        raw = model.linear(f.contiguous(), self.weights.f_b, None).float().view(n, t.num_heads, t.head_dim)
        g = self.weights.neg_decay_rate * F.softplus(raw + self.weights.dt_bias)
        return q, k, v, g, torch.sigmoid(b).float()

    def _output(self, model, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The attention's fp32 out [n, H, d] and g_a(x) [n, d] -> o_proj(sigmoid-gated norm) [n, hidden]."""
        n, dtype = out.shape[0], gate.dtype
        gate = model.linear(gate.contiguous(), self.weights.g_b, None).view(out.shape)
        h = out.to(dtype).float()
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        gated = (self.weights.norm.float() * h * torch.sigmoid(gate.float())).to(dtype)
        return model.linear(gated.reshape(n, -1), self.weights.out, None)


def kda_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              states: torch.Tensor) -> torch.Tensor:
    """One token of each of s sequences through the KDA delta rule, in fp32.

    q, k, v, g [s, H, d]; beta [s, H]; states [s, H, d, d], updated in place. Returns o [s, H, d]."""
    states.mul_(g.exp().unsqueeze(-1))  # row i (key channel i) decays by exp(g[i])
    predicted = (k.unsqueeze(-2) @ states).squeeze(-2)  # [s, H, d]
    correction = (v - predicted) * beta.unsqueeze(-1)
    states.addcmul_(k.unsqueeze(-1), correction.unsqueeze(-2))
    return (q.unsqueeze(-2) @ states).squeeze(-2)


def chunked_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk_size: int = CHUNK_SIZE, solve=unit_lower_solve) -> torch.Tensor:
    """One sequence's n tokens through the KDA delta rule, chunk by chunk, in fp32; solve: the
    layer ops' unit_lower_solve (workers/recurrent.py's, torch's, by default).

    q, k, v, g [H, n, d]; beta [H, n]; state [H, d, d], updated in place to the state after the
    n tokens. Returns o [H, n, d], as n kda_step_ calls would give.

    chunked_delta_rule's algebra (workers/gated_delta.py) with the decay per key channel: with
    c_i [d] the cumulative log decay through token i of the chunk, the pairwise weights are
    A_ij = sum_e k_i[e] k_j[e] exp(c_i[e] - c_j[e]) (and the same with q_i) for j <= i; the
    state enters as (k_i * exp(c_i)) S_0 and leaves as diag(exp(c_L)) S_0 + sum_j (k_j *
    exp(c_L - c_j)) u_j^T. The exponents are taken as differences ([L, L, d] per head and chunk,
    each <= 0 where used), never as exp(c) and exp(-c) apart, which overflow under strong decay."""
    num_heads, n, _ = k.shape
    chunk_size = min(chunk_size, n)  # fewer tokens than a chunk: one chunk of their own length
    pad = (-n) % chunk_size  # padded tokens: g 0 (no decay), beta 0 and k 0 (no write)

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [H, n, ...] -> [H, num_chunks, chunk_size, ...]
        padded = F.pad(x, (0, 0, 0, pad)) if x.dim() == 3 else F.pad(x, (0, pad))
        return padded.view(num_heads, -1, chunk_size, *x.shape[2:])

    q, k, v, g, beta = (chunked(x.float()) for x in (q, k, v, g, beta))
    decay = g.cumsum(dim=2)  # [H, C, L, d]: c_i
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(v)
    s = state.float()
    for c in range(q.shape[1]):
        qc, kc, vc, cc, bc = q[:, c], k[:, c], v[:, c], decay[:, c], beta[:, c]
        pairwise = decay_weights((cc.unsqueeze(2) - cc.unsqueeze(1)).masked_fill(~causal[..., None], float("-inf")))
        k_pairs = torch.einsum("hie,hje,hije->hij", kc, kc, pairwise)  # [H, L, L]
        scores = torch.einsum("hie,hje,hije->hij", qc, kc, pairwise)
        k_beta = kc * bc.unsqueeze(-1)
        system = k_pairs * bc.unsqueeze(-1)  # its diagonal is ignored: T is unit triangular
        solved = solve(system, torch.cat([vc * bc.unsqueeze(-1), k_beta * decay_weights(cc)], dim=-1))
        u_from_values, u_per_state = solved.split([vc.shape[-1], kc.shape[-1]], dim=-1)
        u = u_from_values - u_per_state @ s
        out[:, c] = (qc * decay_weights(cc)) @ s + scores.masked_fill(~causal, 0) @ u
        end = cc[:, -1:]  # [H, 1, d]
        s = s * decay_weights(end.mT) + (kc * decay_weights(end - cc)).mT @ u
    state.copy_(s)
    return out.view(num_heads, -1, v.shape[-1])[:, :n]
