"""The Mamba-2 mixer of Granite 4's mamba layers, in torch, over the recurrent state pool.

Per token, with x the layer's normed input [hidden] (Mamba2Traits: workers/families.py; H heads
of width P, G groups, state size N, inner = H * P):

    gate, xbc, dt = split(in_proj(x))                     [inner], [inner + 2 G N], [H]
    xbc           = silu(causal_conv(xbc))                the conv continues from the last K - 1 inputs
    u, B, C       = split(xbc)                            [H, P], [G, N], [G, N]; head h reads group h // (H / G)
    dt            = clamp(softplus(dt + dt_bias))         [H]
    h             = exp(dt * A) * h + dt * u (x) B        per head [P, N]; A = -exp(A_log)
    y             = h @ C + D * u                         [H, P]
    out           = out_proj(gated_rms_norm(y * silu(gate)))   the norm over each group's inner / G values

Falcon-H1's mixer (Mamba2Traits' gated_norm, multipliers) norms y before the gate, or has no norm
(out_proj(y * silu(gate))); its µP multipliers on in_proj's input, on in_proj's five output parts
and on out_proj's output are folded into in_proj's and out_proj's rows at load.

A sequence's state is its conv's last K - 1 inputs [K - 1, conv_channels] (the model's dtype)
and h [H, P, N] (fp32). Decodes take one recurrent step for every sequence at once. A prompt
(or a piece of one) runs the chunked form of the same recurrence (the "state space duality"
of Mamba-2): within each chunk of chunk_size tokens the outputs are a masked, decay-weighted
attention of C over B; across chunks only the states at the chunk ends are carried. Both forms
start from the carried state and leave the state after their last token, so a prompt cut
anywhere (a chunked prefill, a prefix-cache snapshot) gives the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.families import Mamba2Traits
from workers.recurrent import StatePool, causal_conv, decay_weights


# The most tokens per chunk of a prompt's scan. Any chunking gives the same result; the work within
# a chunk grows with its square. A 512-token prompt at Granite 4.0-H's heads (32 x 64, N = 128), 2
# threads: 94 ms a layer in chunks of 256 (the checkpoints' mamba_chunk_size), 26 in 128, 24 in 64,
# 22 in 32, 50 in 16.
SCAN_CHUNK = 64


@dataclass(slots=True)
class Mamba2Weights:
    """One mamba layer's tensors; in_proj and out_proj in the linear backend's packed form."""

    in_proj: object  # [inner + conv_channels + heads, hidden]: gate, x ++ B ++ C, dt
    in_proj_bias: torch.Tensor | None  # [inner + conv_channels + heads]
    conv: torch.Tensor  # [conv_channels, conv_kernel]: the depthwise causal conv
    conv_bias: torch.Tensor | None  # [conv_channels]
    dt_bias: torch.Tensor  # [heads] fp32
    decay_rate: torch.Tensor  # [heads] fp32: A = -exp(A_log), each head's (negative) continuous decay
    skip: torch.Tensor  # [heads] fp32: D, u's direct path to y
    norm: torch.Tensor | None  # [inner]: the gated RMSNorm's weight; None: no norm (Mamba2Traits.gated_norm)
    out_proj: object  # [hidden, inner] (x the family's residual multiplier and the mixer's output multiplier)
    out_proj_bias: torch.Tensor | None  # [hidden] (likewise)


def read_mamba2_weights(reader, prefix: str, traits: Mamba2Traits, hidden: int) -> Mamba2Weights:
    """The layer's Mamba-2 tensors as transformers names them under prefix ("model.layers.N.mamba.")
    (reader: model.py's _WeightReader)."""
    t = traits

    def plain(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = reader.take(prefix + name, shape)
        if not isinstance(tensor, torch.Tensor):
            raise reader.error(f"{prefix + name} is a {tensor.label} weight; a Mamba-2 mixer takes plain weights here")
        return tensor

    def per_head(name: str) -> torch.Tensor:
        return plain(name, (t.num_heads,)).float()

    # [in_proj_rows]: each output part's multiplier (in_proj_multipliers); the weight's rows also x input_multiplier
    row_scales = torch.cat([torch.full((rows,), m, dtype=torch.float32)
                            for rows, m in zip(t.in_proj_parts, t.in_proj_multipliers)])
    in_proj = reader.take(prefix + "in_proj.weight", (t.in_proj_rows, hidden))
    in_proj_bias = plain("in_proj.bias", (t.in_proj_rows,)) if t.proj_bias else None
    out_proj = reader.take_residual_branch(prefix + "out_proj.weight", (hidden, t.inner))
    out_proj_bias = reader.take_residual_branch(prefix + "out_proj.bias", (hidden,)) if t.out_proj_bias else None
    return Mamba2Weights(
        in_proj=reader.pack(reader.scaled(prefix + "in_proj.weight", in_proj, row_scales[:, None] * t.input_multiplier)),
        in_proj_bias=None if in_proj_bias is None else reader.scaled(prefix + "in_proj.bias", in_proj_bias, row_scales),
        conv=plain("conv1d.weight", (t.conv_channels, 1, t.conv_kernel)).view(t.conv_channels, t.conv_kernel),
        conv_bias=plain("conv1d.bias", (t.conv_channels,)) if t.conv_bias else None,
        dt_bias=per_head("dt_bias"),
        decay_rate=-torch.exp(per_head("A_log")),
        skip=per_head("D"),
        norm=reader.take_norm(prefix, "norm", t.inner) if t.gated_norm is not None else None,
        out_proj=reader.pack(reader.scaled(prefix + "out_proj.weight", out_proj, t.output_multiplier)),
        out_proj_bias=None if out_proj_bias is None else reader.scaled(prefix + "out_proj.bias", out_proj_bias,
                                                                       t.output_multiplier),
    )


class Mamba2Mixer:
    """A mamba layer as a mixer of workers/recurrent.py: state_specs, prefill, decode."""

    def __init__(self, weights: Mamba2Weights, traits: Mamba2Traits) -> None:
        self.weights, self.traits = weights, traits

    def state_specs(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """The conv's last K - 1 inputs (the model's dtype) and the SSM state per head (fp32)."""
        t = self.traits
        return (((t.conv_kernel - 1, t.conv_channels), self.weights.conv.dtype),
                ((t.num_heads, t.head_dim, t.state_size), torch.float32))

    def prefill(self, model, x: torch.Tensor, pool: StatePool, row: int) -> torch.Tensor:
        """One sequence's next n tokens x [n, hidden] -> [n, hidden], from and into pool[i][row]."""
        w, t = self.weights, self.traits
        conv_state, ssm_state = pool[0][row], pool[1][row]
        gate, xbc, dt = self._project(model, x)
        u, B, C = split_conv_output(F.silu(causal_conv(xbc, w.conv, w.conv_bias, conv_state)), t)
        dt = time_steps(dt, w, t)
        if x.shape[0] == 1:
            y = ssm_step(u, dt, w.decay_rate, B, C, pool[1], torch.tensor([row], dtype=torch.long, device=x.device))
        else:
            y, final = ssd_scan(u, dt, w.decay_rate, B, C, ssm_state, min(t.chunk_size, SCAN_CHUNK))
            ssm_state.copy_(final)
        gated = gated_output(y + w.skip[:, None] * u, gate, w, t)
        return model.linear(gated.to(x.dtype), w.out_proj, w.out_proj_bias)

    def decode(self, model, x: torch.Tensor, pool: StatePool, rows: torch.Tensor) -> torch.Tensor:
        """One token of each of s sequences x [s, hidden] -> [s, hidden]: one batched recurrent
        step over the states pool[i][rows] (rows [s] int64), in the layer ops (our C kernels on CPU)."""
        w = self.weights
        gate, xbc, dt = self._project(model, x)
        xbc = model.ops.conv_step(xbc, w.conv, w.conv_bias, pool[0], rows, silu=True)
        gated = model.ops.mamba2_step(xbc, dt, gate, w, self.traits, pool[1], rows)
        return model.linear(gated, w.out_proj, w.out_proj_bias)

    def _project(self, model, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> gate [T, inner], x ++ B ++ C [T, conv_channels], dt [T, heads]."""
        t = self.traits
        projected = model.linear(x, self.weights.in_proj, self.weights.in_proj_bias)
        return projected.split([t.inner, t.conv_channels, t.num_heads], dim=-1)


def split_conv_output(xbc: torch.Tensor, t: Mamba2Traits) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv's output [T, conv_channels] -> u [T, H, P], B and C [T, G, N], all fp32 views."""
    width = t.num_groups * t.state_size
    u, B, C = xbc.float().split([t.inner, width, width], dim=-1)
    return (u.view(-1, t.num_heads, t.head_dim), B.view(-1, t.num_groups, t.state_size),
            C.view(-1, t.num_groups, t.state_size))


def time_steps(dt: torch.Tensor, weights: Mamba2Weights, t: Mamba2Traits) -> torch.Tensor:
    """dt [T, heads] from in_proj -> the time steps softplus(dt + dt_bias), clamped, fp32."""
    return F.softplus(dt.float() + weights.dt_bias).clamp(t.time_step_min, t.time_step_max)


def gated_output(y: torch.Tensor, gate: torch.Tensor, w: Mamba2Weights, t: Mamba2Traits) -> torch.Tensor:
    """y [T, H, P] (with its D term), gated and normed per group -> out_proj's input [T, inner], fp32."""
    y = y.reshape(y.shape[0], t.inner)
    if t.gated_norm == "after_gate":
        return gated_group_rms_norm(y, gate, w.norm, t.num_groups, t.norm_eps)
    if t.gated_norm == "before_gate":
        return group_rms_norm(y, w.norm, t.num_groups, t.norm_eps) * F.silu(gate.float())
    return y.float() * F.silu(gate.float())


def gated_step(xbc: torch.Tensor, dt: torch.Tensor, gate: torch.Tensor, w: Mamba2Weights, t: Mamba2Traits,
               states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A decode step of s sequences from the conv's SiLU'd output xbc [s, conv_channels], in_proj's
    dt [s, H] and gate [s, inner] to out_proj's input [s, inner] in xbc's dtype; states [num_rows,
    H, P, N] fp32 (states[rows] updated). The layer ops' reference (workers/layer_ops.py)."""
    u, B, C = split_conv_output(xbc, t)
    y = ssm_step(u, time_steps(dt, w, t), w.decay_rate, B, C, states, rows)
    return gated_output(y + w.skip[:, None] * u, gate, w, t).to(xbc.dtype)


def ssm_step(u: torch.Tensor, dt: torch.Tensor, decay_rate: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """One recurrent step of s sequences: u [s, H, P], dt [s, H], decay_rate [H], B and C [s, G, N]
    (head h reads group h // (H / G)); states [num_rows, H, P, N] fp32, rows [s] (states[rows]
    updated). Returns y = h @ C [s, H, P] (no D term)."""
    B, C = per_head(B, u.shape[1]), per_head(C, u.shape[1])
    h = states.index_select(0, rows)
    decay = torch.exp(dt * decay_rate)  # [s, H]
    h = h * decay[:, :, None, None] + (u * dt[:, :, None]).unsqueeze(-1) * B.unsqueeze(2)
    states.index_copy_(0, rows, h)
    return torch.einsum("shpn,shn->shp", h, C)


def per_head(groups: torch.Tensor, num_heads: int) -> torch.Tensor:
    """B or C [T, G, N] -> [T, H, N]: each group's row repeated for its H / G heads."""
    return groups.repeat_interleave(num_heads // groups.shape[1], dim=1)


def gated_group_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, num_groups: int,
                         eps: float) -> torch.Tensor:
    """RMSNorm of y * silu(gate) over each of num_groups equal groups of its last dimension, in
    fp32; y, gate [T, inner], weight [inner] -> [T, inner] fp32."""
    return group_rms_norm(y.float() * F.silu(gate.float()), weight, num_groups, eps)


def group_rms_norm(y: torch.Tensor, weight: torch.Tensor, num_groups: int, eps: float) -> torch.Tensor:
    """RMSNorm of y over each of num_groups equal groups of its last dimension, in fp32; y [T, inner],
    weight [inner] -> [T, inner] fp32."""
    y = y.float()
    grouped = y.view(y.shape[0], num_groups, -1)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return normed.view_as(y) * weight.float()


def ssd_scan(u: torch.Tensor, dt: torch.Tensor, decay_rate: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             initial: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of ssm_step over one sequence's n tokens at once, in chunks of chunk_size.

    u [n, H, P], dt [n, H], decay_rate [H], B and C [n, G, N], initial [H, P, N]: the state
    before the first token. Returns y [n, H, P] (no D term) and the state after the last token
    [H, P, N]. The tokens are padded to whole chunks with dt = 0, which neither decays the state
    nor adds to it; fewer than chunk_size tokens are one chunk of their own length (a prefix hit's
    last 16 tokens are not padded to a whole chunk).

        chunk c, tokens l, s in it; a = dt * A; cum[l] = a[0] + ... + a[l] (within the chunk)
        y[l]     = sum_{s <= l} exp(cum[l] - cum[s]) (C[l] . B[s]) dt[s] u[s]      within the chunk
                 + exp(cum[l]) C[l] @ start[c]                                   the state carried in
        end[c]   = sum_s exp(cum[last] - cum[s]) dt[s] u[s] (x) B[s]             what chunk c adds
        start[c] = exp(cum_c-1[last]) start[c - 1] + end[c - 1],  start[0] = initial
    """
    n = u.shape[0]
    chunk_size = min(chunk_size, n)
    pad = -n % chunk_size
    B, C = per_head(B, u.shape[1]), per_head(C, u.shape[1])

    def chunked(tensor: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [chunks, chunk_size, ...]
        padded = F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, pad))
        return padded.view(-1, chunk_size, *tensor.shape[1:])

    log_decay = chunked(dt * decay_rate).permute(0, 2, 1)  # [chunks, H, Q]
    inputs = chunked(u * dt[:, :, None])  # [chunks, Q, H, P]: dt[s] u[s]
    B, C = chunked(B), chunked(C)  # [chunks, Q, H, N]
    cumulative = log_decay.cumsum(-1)  # [chunks, H, Q]
    within = decay_weights(segment_sums(log_decay))  # [chunks, H, Q, Q]: exp(cum[l] - cum[s]), 0 where s > l
    scores = torch.einsum("clhn,cshn->chls", C, B) * within
    y_within = torch.einsum("chls,cshp->clhp", scores, inputs)
    to_end = decay_weights(cumulative[:, :, -1:] - cumulative)  # [chunks, H, Q]
    ends = torch.einsum("clhn,chl,clhp->chpn", B, to_end, inputs)  # [chunks, H, P, N]
    # the states at each chunk's start, and after the last: start[z] = sum_{w <= z} decay(w -> z) carried[w]
    carried = torch.cat([initial.unsqueeze(0).to(ends.dtype), ends], dim=0)  # [chunks + 1, H, P, N]
    chunk_decay = F.pad(cumulative[:, :, -1], (0, 0, 1, 0)).t()  # [H, chunks + 1]: 0, each chunk's total
    across = decay_weights(segment_sums(chunk_decay))  # [H, chunks + 1, chunks + 1]
    starts = torch.einsum("hzw,whpn->zhpn", across, carried)
    y_carried = torch.einsum("clhn,chpn->clhp", C, starts[:-1]) * decay_weights(cumulative).permute(0, 2, 1)[..., None]
    y = (y_within + y_carried).reshape(-1, *u.shape[1:])[:n]
    return y, starts[-1]


def segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a [..., T] -> [..., T, T]: at (l, s) the sum a[s + 1] + ... + a[l] for s <= l (0 on the
    diagonal), -inf above it; by masked cumulative sums, not differences of one cumsum, so that
    large sums do not cancel."""
    size = a.shape[-1]
    below = torch.ones(size, size, dtype=torch.bool, device=a.device).tril(-1)
    terms = a.unsqueeze(-1).expand(*a.shape, size).masked_fill(~below, 0.0)  # [..., k, s]: a[k] where k > s
    sums = terms.cumsum(dim=-2)  # [..., l, s]: sum over s < k <= l
    return sums.masked_fill(~below.logical_or(torch.eye(size, dtype=torch.bool, device=a.device)), -torch.inf)
