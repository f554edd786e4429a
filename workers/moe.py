"""The mixture-of-experts MLP: a router picks top_k experts per token, and each token's MLP
output is the weighted sum of those experts' gated-SiLU MLPs. Plain functions over the
model's linear backend and layer ops, so on CPU each expert's products are our packed ones.

    weights, expert_ids = route(router_logits, traits)           # [tokens, k] fp32, [tokens, k] int64
    delta = moe_mlp(x, layer.moe, linear_backend, ops)          # x: [tokens, hidden] -> [tokens, hidden]

Routing (MoeTraits.scoring, workers/families.py), all in fp32 whatever the model's dtype:

    softmax_topk   p = softmax(logits); the k largest p; divided by their sum iff renormalize
                   (Mixtral always, Qwen3-MoE iff norm_topk_prob)
    topk_softmax   the k largest logits; softmax over those k (gpt-oss, whose router has a bias)

The experts (only those this step's tokens chose run; an expert with no token costs nothing):

    pairs (token, slot) sorted by expert id        argsort of expert_ids.flatten(), stable
    rows = x[token of each sorted pair]            one gather: each expert's rows are a contiguous run
    out_e = down_e(silu(gate_e(rows_e)) * up_e(rows_e))    gate and up fused, one product per expert
    delta[token] += weight(token, slot) * out_e    one index_add_ in fp32, in expert order per token

The per-expert loop reads each expert's token count on the host, so it cannot be captured in
a CUDA graph (it says so). On CUDA, read_moe_weights also keeps the experts stacked
(MoeWeights.stacked; the per-expert weights are views of them, no second copy) and moe_mlp runs
workers/kernels/triton_moe.py's fused_moe instead: one grouped-GEMM launch per projection over
every chosen expert with no host sync, so decode steps of a MoE model can be captured
(tests/gpu/test_gpu.py checks the capture on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.families import MoeTraits


@dataclass(frozen=True, slots=True)
class MoeWeights:
    """One layer's router and experts; products in the linear backend's packed form."""

    traits: MoeTraits
    router: object  # [num_experts, hidden], packed
    router_bias: torch.Tensor | None  # [num_experts] fp32, added to the router's logits
    gate_up: tuple[object, ...]  # per expert [2 * intermediate, hidden], packed: gate rows then up rows
    down: tuple[object, ...]  # per expert [hidden, intermediate], packed
    # CUDA only: (gate_up [E, 2 * intermediate, hidden], down [E, hidden, intermediate]) for the fused
    # Triton kernel, gate_up and down above being views of them; None elsewhere (the per-expert loop)
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None


def route(logits: torch.Tensor, traits: MoeTraits) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, num_experts] (bias included) -> (weights fp32 [tokens, k], expert ids
    int64 [tokens, k]), by the family's scoring (module docstring)."""
    logits = logits.float()
    if traits.scoring == "topk_softmax":
        top_logits, expert_ids = torch.topk(logits, traits.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), expert_ids
    weights, expert_ids = torch.topk(torch.softmax(logits, dim=-1), traits.top_k, dim=-1)
    if traits.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_ids


def router_logits(x: torch.Tensor, weights: MoeWeights, linear_backend) -> torch.Tensor:
    """[tokens, hidden] -> fp32 logits [tokens, num_experts]."""
    logits = linear_backend.logits(x, weights.router)
    return logits if weights.router_bias is None else logits + weights.router_bias


def moe_mlp(x: torch.Tensor, weights: MoeWeights, linear_backend, ops, activation: str = "silu") -> torch.Tensor:
    """The MoE MLP of the normed hidden states x [tokens, hidden] -> [tokens, hidden] in x's dtype."""
    routing, expert_ids = route(router_logits(x, weights, linear_backend), weights.traits)
    if weights.stacked is not None and x.is_cuda:
        from workers.kernels.triton_moe import fused_moe  # triton only where CUDA runs

        return fused_moe(x, *weights.stacked, routing, expert_ids, activation)
    return run_experts(x, routing, expert_ids, weights, linear_backend.linear,
                       lambda gate_up: ops.gated_mul(gate_up, activation))


def run_experts(x: torch.Tensor, routing: torch.Tensor, expert_ids: torch.Tensor, weights: MoeWeights,
                linear, act_mul) -> torch.Tensor:
    """sum over k of routing[t, k] * expert_{expert_ids[t, k]}(x[t]), running each chosen expert
    once over all of its tokens. routing: [tokens, k] fp32; expert_ids: [tokens, k] int64."""
    num_tokens, top_k = expert_ids.shape
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a mixture-of-experts layer cannot be captured in a CUDA graph: it reads each "
                           "expert's token count on the host")
    flat_ids = expert_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
    tokens = order // top_k  # the token of each sorted pair
    rows = x[tokens]  # [tokens * k, hidden]: each expert's rows are one contiguous run
    counts = torch.bincount(flat_ids, minlength=weights.traits.num_experts).tolist()
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            gate_up = linear(rows[start:start + count], weights.gate_up[expert], None)
            outputs.append(linear(act_mul(gate_up), weights.down[expert], None))
            start += count
    expert_out = torch.cat(outputs).float() * routing.flatten()[order].unsqueeze(1)
    return out.index_add_(0, tokens, expert_out).to(x.dtype)


def read_moe_weights(reader, index: int, traits: MoeTraits, hidden: int) -> MoeWeights:
    """Layer `index`'s router and experts out of a checkpoint through the model's weight reader
    (workers/model.py: take, take_fused, take_residual_branch, pack; a missing tensor raises its
    WeightError naming it). Two layouts: transformers' fused one (model.layers.N.mlp.gate.weight,
    mlp.experts.gate_up_proj [E, 2 * I, H], mlp.experts.down_proj [E, H, I]), and the classic
    per-expert tensors under the family's names (MoeTraits.block, expert_projections)."""
    num_experts, width = traits.num_experts, traits.intermediate_size
    prefix = f"model.layers.{index}."
    fused = prefix + "mlp.experts.gate_up_proj"
    if fused in reader.tensors:
        gate = prefix + "mlp.gate."
        stacked_gate_up = reader.take(fused, (num_experts, 2 * width, hidden))
        stacked_down = reader.take_residual_branch(prefix + "mlp.experts.down_proj", (num_experts, hidden, width))
        gate_up, down = list(stacked_gate_up.unbind(0)), list(stacked_down.unbind(0))
        stacked = (stacked_gate_up, stacked_down)
    else:
        block = prefix + traits.block + "."
        gate = block + "gate."
        gate_name, up_name, down_name = traits.expert_projections
        gate_up, down, stacked = [], [], None
        for expert in range(num_experts):
            names = f"{block}experts.{expert}."
            gate_up.append(reader.take_fused([f"{names}{gate_name}.weight", f"{names}{up_name}.weight"],
                                             [(width, hidden)] * 2))
            down.append(reader.take_residual_branch(f"{names}{down_name}.weight", (hidden, width)))
    router = reader.take(gate + "weight", (num_experts, hidden))
    router_bias = reader.take(gate + "bias", (num_experts,)).float() if traits.router_bias else None
    if torch.device(reader.device).type != "cuda":
        stacked = None
    elif stacked is None:  # the torch backend's packed form is the tensor itself: views, not copies
        stacked = (torch.stack(gate_up), torch.stack(down))
        gate_up, down = list(stacked[0].unbind(0)), list(stacked[1].unbind(0))
    return MoeWeights(
        traits=traits, router=reader.pack(router), router_bias=router_bias,
        gate_up=tuple(reader.pack(w.contiguous()) for w in gate_up),
        down=tuple(reader.pack(w.contiguous()) for w in down),
        stacked=stacked,
    )
