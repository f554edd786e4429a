"""The mixture-of-experts MLP: a router picks top_k experts per token, and each token's MLP
output is the weighted sum of those experts' gated MLPs (SiLU, or gpt-oss's clamped SwiGLU). Plain functions over the
model's linear backend and layer ops, so on CPU each expert's products are our packed ones.

    weights, expert_ids = route(router_logits, traits, correction_bias)   # [tokens, k] fp32, [tokens, k] int64
    delta = moe_mlp(x, layer.moe, linear_backend, ops)          # x: [tokens, hidden] -> [tokens, hidden]

Routing (MoeTraits, workers/families.py), all in fp32 whatever the model's dtype, in one function
that the per-expert loop and the fused Triton kernel both take their weights from:

    topk_softmax   the k largest logits; softmax over those k (gpt-oss, whose router has a bias)
    topk_sigmoid   the k largest logits; the sigmoid of each (Llama 4)
    softmax_topk   p = softmax(logits)                           (Mixtral, Qwen-MoE)
    sigmoid_topk   p = sigmoid(logits)                           (GLM-4.5, MiniMax-M2)
       then        c = p + correction_bias                       choice scores (e_score_correction_bias)
                   groups: c's experts in num_groups groups of E / num_groups; each group's score is the
                   sum of its two largest c; outside the topk_groups best groups, c = -inf
                   the k experts of largest c; their weights are p (unbiased)
                   divided by their sum iff renormalize (Mixtral always, Qwen iff norm_topk_prob)
                   times routed_scaling_factor

The experts (only those this step's tokens chose run; an expert with no token costs nothing):

    pairs (token, slot) sorted by expert id        argsort of expert_ids.flatten(), stable
    rows = x[token of each sorted pair]            one gather: each expert's rows are a contiguous run
    out_e = down_e(act(gate_e(rows_e)) * up_e(rows_e))     gate and up fused, one product per expert
                                                   (each with its bias where the family has one: gpt-oss)
    delta[token] += weight(token, slot) * out_e    one index_add_ in fp32, in expert order per token

A family whose weights scale the experts' inputs (Llama 4, MoeTraits.weight_inputs: expert_e(x * w),
which the gated MLP makes differ from w * expert_e(x)) runs the same code on one row per (token,
slot) pair, x * w, each choosing its one expert at weight 1, and sums each token's k rows after.

A shared expert (Qwen2-MoE, GLM-4.5: MoeTraits.shared_intermediate_size) runs on every token beside
them, a dense gated MLP whose output, times sigmoid(x . shared_gate) where the family has that
gate (Qwen2-MoE), is added to the routed experts' sum.

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
from workers.mxfp4 import GROUP_SIZE, dequantize_mxfp4


@dataclass(frozen=True, slots=True)
class MoeWeights:
    """One layer's router and experts; products in the linear backend's packed form."""

    traits: MoeTraits
    router: object  # [num_experts, hidden], packed
    router_bias: torch.Tensor | None  # [num_experts] fp32, added to the router's logits
    gate_up: tuple[object, ...]  # per expert [2 * intermediate, hidden], packed: gate rows then up rows
    down: tuple[object, ...]  # per expert [hidden, intermediate], packed
    gate_up_bias: tuple[torch.Tensor, ...] | None = None  # per expert [2 * intermediate]: gate's then up's (gpt-oss)
    down_bias: tuple[torch.Tensor, ...] | None = None  # per expert [hidden]
    # CUDA only: (gate_up [E, 2 * intermediate, hidden], down [E, hidden, intermediate]) for the fused
    # Triton kernel, gate_up and down above being views of them; None elsewhere (the per-expert loop)
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None
    shared_gate_up: object | None = None  # the shared expert's [2 * shared width, hidden], packed; None: none
    shared_down: object | None = None  # [hidden, shared width], packed
    shared_gate: object | None = None  # [1, hidden], packed: its output's sigmoid gate; None: ungated
    correction_bias: torch.Tensor | None = None  # [num_experts] fp32, added to the scores to choose experts


def route(logits: torch.Tensor, traits: MoeTraits,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [tokens, num_experts] (router bias included) and the choice's correction bias
    [num_experts] -> (weights fp32 [tokens, k], expert ids int64 [tokens, k]), by the family's
    scoring (module docstring). No host sync: CUDA graphs capture it."""
    logits = logits.float()
    if traits.scoring in ("topk_softmax", "topk_sigmoid"):
        top_logits, expert_ids = torch.topk(logits, traits.top_k, dim=-1)
        scores = torch.softmax(top_logits, dim=-1) if traits.scoring == "topk_softmax" else torch.sigmoid(top_logits)
        return scores, expert_ids
    scores = torch.sigmoid(logits) if traits.scoring == "sigmoid_topk" else torch.softmax(logits, dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias
    if traits.num_groups > 1:
        choice = _limit_to_groups(choice, traits.num_groups, traits.topk_groups)
    expert_ids = torch.topk(choice, traits.top_k, dim=-1)[1]
    weights = scores.gather(1, expert_ids)
    if traits.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if traits.routed_scaling_factor != 1.0:
        weights = weights * traits.routed_scaling_factor
    return weights, expert_ids


def _limit_to_groups(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """choice [tokens, E] with -inf outside each token's topk_groups groups (of E / num_groups
    experts) whose two largest scores sum highest."""
    grouped = choice.view(choice.shape[0], num_groups, choice.shape[1] // num_groups)  # [tokens, groups, per group]
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [tokens, groups]
    best_groups = group_scores.topk(topk_groups, dim=-1)[1]
    kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice)


def router_logits(x: torch.Tensor, weights: MoeWeights, linear_backend) -> torch.Tensor:
    """[tokens, hidden] -> fp32 logits [tokens, num_experts]."""
    logits = linear_backend.logits(x, weights.router)
    return logits if weights.router_bias is None else logits + weights.router_bias


def moe_mlp(x: torch.Tensor, weights: MoeWeights, linear_backend, ops, activation: str = "silu") -> torch.Tensor:
    """The MoE MLP of the normed hidden states x [tokens, hidden] -> [tokens, hidden] in x's dtype."""
    traits = weights.traits
    routing, expert_ids = route(router_logits(x, weights, linear_backend), traits, weights.correction_bias)
    routed_x = x
    if traits.weight_inputs:  # a row per (token, slot): x * w, its one expert at weight 1 (module docstring)
        routed_x = x.repeat_interleave(traits.top_k, dim=0) * routing.to(x.dtype).view(-1, 1)
        routing, expert_ids = torch.ones_like(routing).view(-1, 1), expert_ids.view(-1, 1)
    if traits.activation == "swiglu_oai":
        def act_mul(gate_up):
            return ops.gated_mul(gate_up, "swiglu_oai", alpha=traits.swiglu_alpha, limit=traits.swiglu_limit)
    else:
        def act_mul(gate_up):
            return ops.gated_mul(gate_up, traits.activation or activation)
    if weights.stacked is not None and x.is_cuda:
        from workers.kernels.triton_moe import fused_moe  # triton only where CUDA runs

        routed = fused_moe(routed_x, *weights.stacked, routing, expert_ids, traits.activation or activation)
    else:
        routed = run_experts(routed_x, routing, expert_ids, weights, linear_backend.linear, act_mul)
    if traits.weight_inputs:  # each token's k rows summed
        routed = routed.view(x.shape[0], traits.top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
    if weights.shared_gate_up is None:
        return routed
    linear = linear_backend.linear
    shared = linear(act_mul(linear(x, weights.shared_gate_up, None)), weights.shared_down, None).float()
    if weights.shared_gate is not None:
        shared = shared * torch.sigmoid(linear_backend.logits(x, weights.shared_gate))
    return (routed.float() + shared).to(x.dtype)


def run_experts(x: torch.Tensor, routing: torch.Tensor, expert_ids: torch.Tensor, weights: MoeWeights,
                linear, act_mul) -> torch.Tensor:
    """sum over k of routing[t, k] * expert_{expert_ids[t, k]}(x[t]), running each chosen expert
    once over all of its tokens. routing: [tokens, k] fp32; expert_ids: [tokens, k] int64."""
    num_tokens, top_k = expert_ids.shape
    if num_tokens == 0:
        return torch.zeros(0, x.shape[1], dtype=x.dtype, device=x.device)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a mixture-of-experts layer cannot be captured in a CUDA graph: it reads each "
                           "expert's token count on the host")
    flat_ids = expert_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert, tokens ascending
    # Gathers are index_select, not x[...] or index_add_: on a decode step's few rows those two
    # woke torch's OpenMP team and cost about 1 ms each per layer (profile of bench_moe, batch 1).
    rows = x.index_select(0, order // top_k)  # [tokens * k, hidden]: each expert's rows are one contiguous run
    counts = torch.bincount(flat_ids, minlength=weights.traits.num_experts).tolist()
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            gate_up_bias = None if weights.gate_up_bias is None else weights.gate_up_bias[expert]
            down_bias = None if weights.down_bias is None else weights.down_bias[expert]
            gate_up = linear(rows[start:start + count], weights.gate_up[expert], gate_up_bias)
            outputs.append(linear(act_mul(gate_up), weights.down[expert], down_bias))
            start += count
    unsorted = torch.empty_like(order)
    unsorted[order] = torch.arange(order.numel(), device=order.device)  # each pair's row among the sorted ones
    expert_out = torch.cat(outputs).index_select(0, unsorted).float()  # [tokens * k, hidden], pair order
    weighted = expert_out.view(num_tokens, top_k, -1) * routing.unsqueeze(-1)
    return weighted.sum(dim=1).to(x.dtype)


def read_moe_weights(reader, index: int, traits: MoeTraits, hidden: int) -> MoeWeights:
    """Layer `index`'s router and experts out of a checkpoint through the model's weight reader
    (workers/model.py: take, take_fused, residual_branch, pack; a missing tensor raises its
    WeightError naming it). Three layouts: transformers' fused one (model.layers.N.mlp.gate.weight,
    mlp.experts.gate_up_proj [E, 2 * I, H], mlp.experts.down_proj [E, H, I]); the classic
    per-expert tensors under the family's names (MoeTraits.block, expert_projections); and
    gpt-oss's (MoeTraits.expert_layout, _read_gpt_oss_experts)."""
    prefix = f"model.layers.{index}."
    gate_up_bias = down_bias = None
    if traits.expert_layout == "gpt_oss":
        gate_up, down, gate_up_bias, down_bias = _read_gpt_oss_experts(reader, prefix, traits, hidden)
        block = f"{prefix}{traits.block}."
    elif traits.expert_layout == "in_out":
        gate_up, down, block = _read_in_out_experts(reader, prefix, traits, hidden)
    else:
        gate_up, down, block = _read_stacked_experts(reader, prefix, traits, hidden)
    router_name = f"{block}{traits.router}."
    router = reader.take(router_name + "weight", (traits.num_experts, hidden))
    router_bias = reader.take(router_name + "bias", (traits.num_experts,)).float() if traits.router_bias else None
    correction_bias = None
    if traits.correction_bias:
        correction_bias = _take_correction_bias(reader, block, traits)
    stacked = None
    # CUDA: the fused Triton kernel reads the experts stacked (the per-expert tensors become views of
    # the stack); it has no expert biases or clamped SwiGLU, so gpt-oss runs the per-expert loop there
    if torch.device(reader.device).type == "cuda" and gate_up_bias is None and traits.activation != "swiglu_oai":
        stacked = (torch.stack(gate_up), torch.stack(down))
        gate_up, down = list(stacked[0].unbind(0)), list(stacked[1].unbind(0))
    shared_gate_up = shared_down = shared_gate = None
    if traits.shared_intermediate_size:
        shared, width = f"{block}{traits.shared_expert}", traits.shared_intermediate_size
        shared_gate_up = reader.pack(reader.take_gate_up(f"{shared}.", width))  # Granite 4's: one tensor
        shared_down = reader.pack(reader.residual_branch(reader.take(f"{shared}.down_proj.weight", (hidden, width))))
        if traits.shared_expert_gate:
            shared_gate = reader.pack(reader.take(f"{shared}_gate.weight", (1, hidden)))
    return MoeWeights(
        traits=traits, router=reader.pack(router), router_bias=router_bias, correction_bias=correction_bias,
        shared_gate_up=shared_gate_up, shared_down=shared_down, shared_gate=shared_gate,
        gate_up=tuple(reader.pack(w.contiguous()) for w in gate_up),
        down=tuple(reader.pack(w.contiguous()) for w in down),
        gate_up_bias=None if gate_up_bias is None else tuple(b.contiguous() for b in gate_up_bias),
        down_bias=None if down_bias is None else tuple(b.contiguous() for b in down_bias),
        stacked=stacked,
    )


def _take_correction_bias(reader, block: str, traits: MoeTraits) -> torch.Tensor:
    """The block's correction bias, fp32 [E], under the first of its names present (the last one's
    WeightError where none is); [1, E] is ERNIE 4.5's shape (one row per expert group)."""
    name = next((block + n for n in traits.correction_bias if block + n in reader.tensors),
                block + traits.correction_bias[-1])
    stored = reader.tensors.get(name)
    one_row = stored is not None and tuple(stored.shape) == (1, traits.num_experts)
    return reader.take(name, (1, traits.num_experts) if one_row else (traits.num_experts,)).float().view(-1)


def _read_stacked_experts(reader, prefix: str, traits: MoeTraits, hidden: int) -> tuple[list, list, str]:
    """(gate_up per expert, down per expert, the MoE block's name prefix) in transformers' fused layout
    or the classic one."""
    num_experts, width = traits.num_experts, traits.intermediate_size
    fused = prefix + "mlp.experts.gate_up_proj"
    if fused in reader.tensors:
        stacked_gate_up = reader.take(fused, (num_experts, 2 * width, hidden))
        stacked_down = reader.residual_branch(reader.take(prefix + "mlp.experts.down_proj",
                                                          (num_experts, hidden, width)))
        return list(stacked_gate_up.unbind(0)), list(stacked_down.unbind(0)), prefix + "mlp."
    block = prefix + traits.block + "."
    gate_name, up_name, down_name = traits.expert_projections
    gate_up, down = [], []
    for expert in range(num_experts):
        names = f"{block}experts.{expert}."
        gate_up.append(reader.take_fused([f"{names}{gate_name}.weight", f"{names}{up_name}.weight"],
                                         [(width, hidden)] * 2))
        down.append(reader.residual_branch(reader.take(f"{names}{down_name}.weight", (hidden, width))))
    return gate_up, down, block


def _read_in_out_experts(reader, prefix: str, traits: MoeTraits, hidden: int) -> tuple[list, list, str]:
    """Llama 4's experts: {block}.experts.gate_up_proj [E, H, 2 * I] (the gate's columns, then the up's) and
    down_proj [E, I, H], each [E, in, out]; returned as ours, per expert [2 * I, H] and [H, I]."""
    num_experts, width, block = traits.num_experts, traits.intermediate_size, f"{prefix}{traits.block}."
    gate_up = reader.take(block + "experts.gate_up_proj", (num_experts, hidden, 2 * width)).transpose(1, 2)
    down = reader.residual_branch(reader.take(block + "experts.down_proj", (num_experts, width, hidden)))
    return list(gate_up.unbind(0)), list(down.transpose(1, 2).unbind(0)), block


def _read_gpt_oss_experts(reader, prefix: str, traits: MoeTraits, hidden: int) -> tuple[list, list, list, list]:
    """gpt-oss's experts: mlp.experts.gate_up_proj [E, H, 2 * I] with gate and up interleaved
    (column 2j is gate j, 2j + 1 is up j), gate_up_proj_bias [E, 2 * I] likewise, down_proj
    [E, I, H], down_proj_bias [E, H]; or, for each projection, MXFP4 {proj}_blocks and
    {proj}_scales (workers/mxfp4.py) already [E, out, in]. Returned as ours: per expert
    [2 * I, H] with the gate rows then the up rows, [2 * I] biases likewise, [H, I] and [H]."""
    num_experts, width = traits.num_experts, traits.intermediate_size
    experts = prefix + f"{traits.block}.experts."
    stacked_gate_up_bias = reader.take(experts + "gate_up_proj_bias", (num_experts, 2 * width))
    stacked_down_bias = reader.residual_branch(reader.take(experts + "down_proj_bias", (num_experts, hidden)))
    dtype = stacked_gate_up_bias.dtype  # the model's (the loader casts floating tensors to it)
    stacked_gate_up = _take_expert_matrix(reader, experts + "gate_up_proj", num_experts, hidden, 2 * width, dtype)
    stacked_down = reader.residual_branch(_take_expert_matrix(reader, experts + "down_proj", num_experts, width,
                                                              hidden, dtype))

    def halves(interleaved: torch.Tensor) -> torch.Tensor:  # [E, 2 * I, ...] rows: gate j, up j, ... -> gates, ups
        return torch.cat((interleaved[:, 0::2], interleaved[:, 1::2]), dim=1)

    return (list(halves(stacked_gate_up).unbind(0)), list(stacked_down.unbind(0)),
            list(halves(stacked_gate_up_bias).unbind(0)), list(stacked_down_bias.unbind(0)))


def _take_expert_matrix(reader, name: str, num_experts: int, num_in: int, num_out: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """[E, out, in] from gpt-oss's [E, in, out] tensor `name`, or from its MXFP4 blocks and scales."""
    if name + "_blocks" not in reader.tensors and (name in reader.tensors or reader.config.quantization is None):
        return reader.take(name, (num_experts, num_in, num_out)).transpose(1, 2)
    if num_in % GROUP_SIZE:
        raise reader.error(f"{name}_blocks: an input width of {num_in} is not a multiple of {GROUP_SIZE}")
    groups = num_in // GROUP_SIZE
    blocks = reader.take(name + "_blocks", (num_experts, num_out, groups, GROUP_SIZE // 2))
    scales = reader.take(name + "_scales", (num_experts, num_out, groups))
    for tensor, what in ((blocks, "_blocks"), (scales, "_scales")):
        if tensor.dtype != torch.uint8:
            raise reader.error(f"{name}{what} is {tensor.dtype}, expected uint8 (MXFP4)")
    return dequantize_mxfp4(blocks, scales, dtype)
