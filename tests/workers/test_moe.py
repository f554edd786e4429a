"""Mixture-of-experts layers (workers/moe.py, the mixtral and qwen3_moe families).

The router against a float64 reference and against transformers' own router modules (Mixtral,
Qwen3-MoE, and gpt-oss's top-k-then-softmax with a bias); the experts
against a float64 sum over every expert, running only the experts the tokens chose; and tiny
random checkpoints built with transformers' classes, whose greedy tokens and logprobs equal
transformers' on the torch path and on our CPU kernels and products (the Python layer loop:
the C loop has no MoE), with chunked prompts beside decodes. Missing or extra expert tensors
fail with one line naming them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from families_catalog import MOE_FAMILIES
from runner_helpers import (HfOracle, assert_greedy_matches, assert_logprobs_match_hf, greedy, make_runner,
                            prompts_of_lengths, run_requests, run_with_logprobs)
from safetensors.torch import load_file, save_file
from tiny_model import build_tiny_model_dir

from scheduler.sampling_params import SamplingParams
from workers.config import ModelConfig, ModelConfigError
from workers.families import MoeTraits
from workers.kernels import get_attention_backend
from workers.kernels.native import native_available
from workers.layer_ops import NativeOps, TorchOps
from workers.linear import NativeLinear, TorchLinear
from workers.loader import ModelPathError
from workers.model import PagedLlamaModel, WeightError
from workers.moe import MoeWeights, moe_mlp, route, router_logits, run_experts
from workers.simple_driver import SimpleDriver

CHECKPOINTS = MOE_FAMILIES
PATHS = {
    "torch": dict(attention_backend="torch", layer_ops="torch", linear_backend="torch"),
    "cpu": dict(attention_backend="cpu"),  # our attention, C ops and packed products; the Python layer loop
}


def float64_route(logits: torch.Tensor, traits: MoeTraits,
                  correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of the module docstring, row by row in float64 with Python's sort."""
    all_weights, all_ids = [], []
    num_experts = logits.shape[1]
    bias = torch.zeros(num_experts, dtype=torch.float64) if correction_bias is None else correction_bias.double()
    for row in logits.double():
        if traits.scoring in ("topk_softmax", "topk_sigmoid"):
            ranked = sorted(range(num_experts), key=lambda expert: -float(row[expert]))[:traits.top_k]
            top = row[ranked]
            all_weights.append(torch.softmax(top, dim=0) if traits.scoring == "topk_softmax" else torch.sigmoid(top))
            all_ids.append(ranked)
            continue
        scores = torch.sigmoid(row) if traits.scoring == "sigmoid_topk" else torch.softmax(row, dim=0)
        choice = [float(score) for score in scores + bias]
        size = num_experts // traits.num_groups
        groups = [list(range(group * size, (group + 1) * size)) for group in range(traits.num_groups)]
        if traits.num_groups > 1:  # the groups whose two best choice scores sum highest
            groups.sort(key=lambda experts: -sum(sorted((choice[e] for e in experts), reverse=True)[:2]))
        allowed = [expert for experts in groups[:traits.topk_groups] for expert in experts]
        ranked = sorted(allowed, key=lambda expert: -choice[expert])[:traits.top_k]
        weights = scores[ranked]
        if traits.renormalize:
            weights = weights / weights.sum()
        all_weights.append(weights * traits.routed_scaling_factor)
        all_ids.append(ranked)
    return torch.stack(all_weights), torch.tensor(all_ids)


def traits_of(scoring: str = "softmax_topk", renormalize: bool = True, num_experts: int = 16,
              top_k: int = 4, router_bias: bool = False, **routing) -> MoeTraits:
    return MoeTraits(num_experts=num_experts, top_k=top_k, intermediate_size=8, layers=(True,), scoring=scoring,
                     renormalize=renormalize, router_bias=router_bias, **routing)


GROUPED = dict(num_groups=4, topk_groups=2, routed_scaling_factor=2.5)  # GLM-4.5's and DeepSeek V3's shape
GROUPED_CONFIG = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)  # the same in a config.json


CORRECTED = dict(biased=True)  # a correction bias on the choice (e_score_correction_bias)


@pytest.mark.parametrize("scoring,renormalize,routing", [
    ("softmax_topk", True, {}), ("softmax_topk", False, {}), ("topk_softmax", False, {}), ("sigmoid_topk", True, {}),
    ("softmax_topk", True, CORRECTED), ("sigmoid_topk", True, CORRECTED), ("sigmoid_topk", False, GROUPED),
    ("sigmoid_topk", True, dict(GROUPED, **CORRECTED)), ("sigmoid_topk", False, dict(GROUPED, **CORRECTED)),
    ("topk_sigmoid", False, {}),
], ids=["softmax", "softmax-not-renormalised", "topk_softmax", "sigmoid", "softmax-corrected", "sigmoid-corrected",
        "sigmoid-grouped", "sigmoid-grouped-corrected", "sigmoid-grouped-corrected-not-renormalised", "topk_sigmoid"])
def test_routing_equals_float64(scoring, renormalize, routing):
    routing = dict(routing)
    biased = routing.pop("biased", False)
    traits = traits_of(scoring, renormalize, **routing)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, traits.num_experts, generator=generator) * 3
    bias = torch.randn(traits.num_experts, generator=generator) * 0.5 if biased else None
    weights, expert_ids = route(logits, traits, bias)
    expected_weights, expected_ids = float64_route(logits, traits, bias)
    assert weights.dtype == torch.float32 and expert_ids.dtype == torch.int64
    assert torch.equal(expert_ids, expected_ids)
    torch.testing.assert_close(weights.double(), expected_weights, atol=1e-6, rtol=0)
    sums = weights.sum(dim=-1) / traits.routed_scaling_factor
    if renormalize or scoring == "topk_softmax":
        torch.testing.assert_close(sums, torch.ones_like(sums))
    elif scoring in ("softmax_topk", "topk_sigmoid"):  # topk_sigmoid: k sigmoids, none renormalised
        assert bool((sums < {"softmax_topk": 1, "topk_sigmoid": traits.top_k}[scoring]).all())
    if biased:  # the bias changes which experts are chosen
        assert not torch.equal(route(logits, traits)[1], expert_ids)
    if traits.num_groups > 1:  # each token's experts come from at most topk_groups groups
        group_size = traits.num_experts // traits.num_groups
        assert all(len(set((row // group_size).tolist())) <= traits.topk_groups for row in expert_ids)
        ungrouped = route(logits, replace(traits, num_groups=1), bias)[1]
        assert not torch.equal(ungrouped, expert_ids)  # and the groups change the choice
    empty_weights, empty_ids = route(logits[:0], traits, bias)  # a step with no tokens
    assert empty_weights.shape == empty_ids.shape == (0, traits.top_k)


def test_router_bias_is_added_before_the_top_k():
    traits = traits_of("topk_softmax", router_bias=True)
    generator = torch.Generator().manual_seed(1)
    x, router = torch.randn(32, 24, generator=generator), torch.randn(traits.num_experts, 24, generator=generator)
    bias = torch.randn(traits.num_experts, generator=generator) * 4  # large enough to change the choice
    weights = MoeWeights(traits, TorchLinear().pack(router), bias, (), ())
    ours_weights, ours_ids = route(router_logits(x, weights, TorchLinear()), traits)
    expected_weights, expected_ids = float64_route(x.double() @ router.double().T + bias.double(), traits)
    assert torch.equal(ours_ids, expected_ids)
    torch.testing.assert_close(ours_weights.double(), expected_weights, atol=1e-6, rtol=0)
    _, unbiased_ids = route(x @ router.T, traits)
    assert not torch.equal(unbiased_ids, ours_ids)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe-renormalised", "gpt_oss", "glm4_moe",
                                    "minimax_m2", "ernie4_5_moe", "llama4_text", "granitemoehybrid",
                                    "qwen3_next-renormalised"])
def test_routing_equals_transformers_routers(family):
    """Our route() on transformers' router modules' logits picks the same experts with the same weights
    (GLM-4.5's and MiniMax-M2's routers list their k in no order: compared by expert id; Llama 4's gives
    every expert's score, 0 where not chosen: compared as ours scattered so)."""
    from transformers import AutoConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridTopKRouter
    from transformers.models.llama4.modeling_llama4 import Llama4Router
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

    model_type = family.split("-")[0]
    mamba = dict(mamba_n_heads=4) if model_type == "granitemoehybrid" else {}  # heads that divide 2 x hidden
    config = AutoConfig.for_model(model_type, hidden_size=32, num_local_experts=8, num_experts=8, num_experts_per_tok=3,
                                  norm_topk_prob=family.endswith("renormalised"), n_routed_experts=8, **GROUPED_CONFIG,
                                  **mamba)
    router_class = {"mixtral": MixtralTopKRouter, "qwen3_moe": Qwen3MoeTopKRouter, "gpt_oss": GptOssTopKRouter,
                    "glm4_moe": Glm4MoeTopkRouter, "minimax_m2": MiniMaxM2TopKRouter,
                    "ernie4_5_moe": Ernie4_5_MoeTopKRouter, "llama4_text": Llama4Router,
                    "granitemoehybrid": GraniteMoeHybridTopKRouter, "qwen3_next": Qwen3NextTopKRouter}
    router = router_class[model_type](config)
    torch.manual_seed(2)
    correction_bias = torch.randn(8) * 0.3 if model_type in ("glm4_moe", "minimax_m2") else None
    with torch.no_grad():
        for parameter in router.parameters():
            parameter.normal_(0.0, 0.5)
        if model_type == "glm4_moe":
            router.e_score_correction_bias.copy_(correction_bias)
    if model_type == "ernie4_5_moe":  # a parameter of its own, [1, E], drawn above
        correction_bias = router.moe_statics.e_score_correction_bias.detach().view(-1)
    traits = {
        "mixtral": traits_of(num_experts=8, top_k=3),
        "qwen3_moe": traits_of(num_experts=8, top_k=3, renormalize=config.norm_topk_prob),
        "qwen3_next": traits_of(num_experts=8, top_k=3, renormalize=config.norm_topk_prob),
        "gpt_oss": traits_of("topk_softmax", num_experts=8, top_k=3, router_bias=True),
        "glm4_moe": traits_of("sigmoid_topk", num_experts=8, top_k=3, renormalize=False, **GROUPED),
        "minimax_m2": traits_of("sigmoid_topk", num_experts=8, top_k=3),
        "ernie4_5_moe": traits_of(num_experts=8, top_k=3),
        "llama4_text": traits_of("topk_sigmoid", renormalize=False, num_experts=8, top_k=3),
        "granitemoehybrid": traits_of("topk_softmax", num_experts=8, top_k=3),
    }[model_type]
    x = torch.randn(40, 32)
    with torch.no_grad():
        if model_type == "llama4_text":  # every expert's score [tokens, E]: the ids are where they are not 0
            hf_scores = router(x)[0]
            hf_ids = hf_scores.topk(3, dim=-1)[1]
            hf_weights = hf_scores.gather(1, hf_ids)
        else:
            _, hf_weights, hf_ids = router(x, correction_bias) if model_type == "minimax_m2" else router(x)
    bias = router.bias.detach() if model_type == "gpt_oss" else None
    weights = MoeWeights(traits, router.weight.detach(), bias, (), (), correction_bias=correction_bias)
    ours_weights, ours_ids = route(router_logits(x, weights, TorchLinear()), traits, weights.correction_bias)
    if model_type in ("glm4_moe", "minimax_m2"):
        ours_ids, order = ours_ids.sort(dim=-1)
        ours_weights = ours_weights.gather(1, order)
        hf_ids, order = hf_ids.sort(dim=-1)
        hf_weights = hf_weights.gather(1, order)
    assert torch.equal(ours_ids, hf_ids)
    torch.testing.assert_close(ours_weights, hf_weights.float(), atol=1e-6, rtol=1e-6)


def random_experts(traits: MoeTraits, hidden: int, linear, seed: int = 3) -> tuple[MoeWeights, list, list]:
    generator = torch.Generator().manual_seed(seed)
    width = traits.intermediate_size
    gate_up = [torch.randn(2 * width, hidden, generator=generator) * 0.3 for _ in range(traits.num_experts)]
    down = [torch.randn(hidden, width, generator=generator) * 0.3 for _ in range(traits.num_experts)]
    router = torch.randn(traits.num_experts, hidden, generator=generator)
    weights = MoeWeights(traits, linear.pack(router), None, tuple(map(linear.pack, gate_up)),
                         tuple(map(linear.pack, down)))
    return weights, gate_up, down


def float64_experts(x, routing, expert_ids, gate_up, down) -> torch.Tensor:
    """Every expert on every token, in float64, weighted by its routing weight where chosen (0 elsewhere)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for expert, (gate_up_e, down_e) in enumerate(zip(gate_up, down)):
        gate, up = (x.double() @ gate_up_e.double().T).chunk(2, dim=-1)
        expert_out = (torch.nn.functional.silu(gate) * up) @ down_e.double().T
        weight = (routing.double() * (expert_ids == expert)).sum(dim=-1, keepdim=True)
        out += weight * expert_out
    return out


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_experts_equal_float64_and_run_only_the_chosen_ones(backend, num_tokens):
    if backend == "native" and not native_available():
        pytest.skip("the C kernels do not build here")
    linear, ops = (TorchLinear(), TorchOps()) if backend == "torch" else (NativeLinear(), NativeOps())
    traits = replace(traits_of(num_experts=12, top_k=3), intermediate_size=20)
    weights, gate_up, down = random_experts(traits, hidden=32, linear=linear)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(num_tokens))
    routing, expert_ids = route(router_logits(x, weights, linear), traits)
    used = []

    def spying_linear(rows, weight, bias):
        used.append(next(e for e, w in enumerate(weights.gate_up + weights.down) if w is weight) % traits.num_experts)
        return linear.linear(rows, weight, bias)

    out = run_experts(x, routing, expert_ids, weights, spying_linear, lambda g: ops.gated_mul(g, "silu"))
    expected = float64_experts(x, routing, expert_ids, gate_up, down)
    torch.testing.assert_close(out.double(), expected, atol=2e-4, rtol=1e-4)
    chosen = sorted(set(expert_ids.flatten().tolist()))
    assert used == [e for e in chosen for _ in range(2)]  # each chosen expert once (gate_up, then down); no other
    if num_tokens == 1:
        assert len(chosen) == traits.top_k < traits.num_experts


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_weights_on_the_inputs_equal_float64(backend):
    """Llama 4's experts take x * w (MoeTraits.weight_inputs): each chosen expert's gated MLP of the
    token times its weight, summed over the k; which is not w * expert(x), the other families' sum."""
    if backend == "native" and not native_available():
        pytest.skip("the C kernels do not build here")
    linear, ops = (TorchLinear(), TorchOps()) if backend == "torch" else (NativeLinear(), NativeOps())
    traits = replace(traits_of("topk_sigmoid", renormalize=False, num_experts=6, top_k=2), intermediate_size=20,
                     weight_inputs=True)
    weights, gate_up, down = random_experts(traits, hidden=32, linear=linear)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(5))
    routing, expert_ids = route(router_logits(x, weights, linear), traits)
    out = moe_mlp(x, weights, linear, ops)
    ones = torch.ones(x.shape[0], 1)
    expected = sum(float64_experts(x * routing[:, [slot]], ones, expert_ids[:, [slot]], gate_up, down)
                   for slot in range(traits.top_k))
    torch.testing.assert_close(out.double(), expected, atol=2e-4, rtol=1e-4)
    on_outputs = float64_experts(x, routing, expert_ids, gate_up, down)
    assert (on_outputs - expected).abs().max() > 0.05


def test_experts_of_no_tokens():
    weights, _, _ = random_experts(traits_of(), hidden=16, linear=TorchLinear())
    out = run_experts(torch.empty(0, 16), torch.empty(0, 4), torch.empty(0, 4, dtype=torch.int64), weights,
                      TorchLinear().linear, lambda g: TorchOps().gated_mul(g, "silu"))
    assert out.shape == (0, 16)


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def moe_dir(request, tmp_path_factory):
    """The checkpoint directory, named as its CHECKPOINTS key."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("moe") / request.param, **CHECKPOINTS[request.param])


def moe_runner(model_dir, path: str, **overrides):
    if path == "cpu" and not native_available():
        pytest.skip("the C kernels do not build here")
    runner = make_runner(model_dir, **PATHS[path], **overrides)
    assert runner.model.native_forward is None  # no C layer loop for MoE layers: the Python loop runs them
    moe_layers = [layer.moe for layer in runner.model.layers if layer.moe is not None]
    assert moe_layers, "the checkpoint has no MoE layer"
    if path == "cpu":  # the experts' products are our packed ones
        assert all(w.native_operand() is not None for moe in moe_layers for w in moe.gate_up + moe.down)
    return runner


@pytest.mark.parametrize("path", sorted(PATHS))
def test_greedy_tokens_equal_transformers(moe_dir, path):
    runner = moe_runner(moe_dir, path)
    oracle = HfOracle(moe_dir)
    prompts = prompts_of_lengths([1, 3, 17, 40], runner.model_info.vocab_size, seed=1)
    outputs = run_requests(runner, prompts, greedy(12), token_budget=16)  # chunked prompts beside decodes
    for prompt, output in zip(prompts, outputs):
        assert_greedy_matches(output, oracle.greedy(prompt, 12))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_logprobs_equal_transformers(moe_dir, path):
    runner = moe_runner(moe_dir, path)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=4),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=4)]
    oracle = HfOracle(moe_dir)
    for request in run_with_logprobs(runner, prompts_of_lengths([21, 5], runner.model_info.vocab_size, seed=2), params):
        assert_logprobs_match_hf(request, oracle, 4)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_llama4_prefix_in_the_pool_gives_transformers_tokens(tmp_path, path):
    """A prompt whose first 13 tokens' KV is already in the pool (a prefix-cache hit ending mid-chunk and
    mid-block): its chunked layers read the chunk's cached keys, the layer without RoPE every cached key
    and its queries' temperatures from their positions; the tokens are transformers'."""
    model_dir = build_tiny_model_dir(tmp_path / "llama4_text", **CHECKPOINTS["llama4_text"])
    runner = moe_runner(model_dir, path)
    prefix, suffix = prompts_of_lengths([13, 11], runner.model_info.vocab_size, seed=4)
    driver = SimpleDriver(runner)
    owner = driver.add_request("owner", prefix, greedy(1), keep_blocks=True)
    driver.run()
    block_size, num_full = runner.block_size, len(prefix) // runner.block_size
    partial_copy = driver.allocate_blocks(1)[0]
    driver.add_request("reuser", prefix + suffix, greedy(8), num_computed_tokens=len(prefix),
                       prefix_block_ids=owner.block_ids[:num_full] + [partial_copy],
                       copy_blocks=[(owner.block_ids[num_full], partial_copy)])
    driver.free_blocks([partial_copy])
    driver.step()
    assert driver.last_output.num_scheduled_tokens["reuser"] == len(suffix) and len(prefix) % block_size
    driver.run()
    assert_greedy_matches(driver.requests["reuser"].output_token_ids, HfOracle(model_dir).greedy(prefix + suffix, 8))


def test_layers_and_model_info(moe_dir):
    config = ModelConfig.from_model_dir(moe_dir)
    settings = CHECKPOINTS[moe_dir.name]
    first_moe = settings.get("first_k_dense_replace", settings.get("moe_layer_start_index", 0))
    step = settings.get("interleave_moe_layer_step", 1)  # Llama 4: every step-th layer
    expected_layers = tuple(layer not in settings.get("mlp_only_layers", []) and layer >= first_moe
                            and (layer + 1) % step == 0 for layer in range(config.num_layers))
    assert config.traits.moe.layers == expected_layers
    assert config.traits.moe.renormalize == settings.get("norm_topk_prob", config.model_type != "llama4_text")
    num_experts = next(settings[key] for key in ("num_local_experts", "num_experts", "n_routed_experts",
                                                 "moe_num_experts") if key in settings)
    assert config.traits.moe.num_experts == num_experts
    qk_norms = {"qwen3_moe": "head", "glm4_moe": "head", "minimax_m2": "projection",
                "hunyuan_v1_moe": "head_after_rope", "llama4_text": "l2_after_rope", "qwen3_next": "head"}
    assert config.traits.qk_norm == qk_norms.get(config.model_type)
    runner = moe_runner(moe_dir, "cpu")
    assert [layer.moe is not None for layer in runner.model.layers] == list(expected_layers)
    assert all((layer.gate_up is None) == (layer.moe is not None) for layer in runner.model.layers)
    info = runner.model_info
    assert (info.model_type, info.layer_loop, info.layer_ops, info.linear_backend) == (
        settings["model_type"], "python", "native", "native")


def test_qwen3_moe_config_reads_the_sparse_step_and_dense_layers():
    raw = dict(model_type="qwen3_moe", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, num_experts=128, num_experts_per_tok=8,
               moe_intermediate_size=768, decoder_sparse_step=2, mlp_only_layers=[3])
    config = ModelConfig.from_dict(raw)
    assert config.traits.moe.layers == (False, True, False, False, False, True)
    assert (config.traits.moe.num_experts, config.traits.moe.top_k, config.traits.moe.intermediate_size) == (128, 8, 768)
    assert not config.traits.moe.renormalize and config.traits.moe.scoring == "softmax_topk"
    assert ModelConfig.from_dict(dict(raw, num_experts=0)).traits.moe is None  # every layer dense
    with pytest.raises(ModelConfigError, match="9 experts per token out of 8"):
        ModelConfig.from_dict(dict(raw, num_experts=8, num_experts_per_tok=9))
    with pytest.raises(ModelConfigError, match="decoder_sparse_step 0"):
        ModelConfig.from_dict(dict(raw, decoder_sparse_step=0))
    with pytest.raises(ModelConfigError, match="use_sliding_window"):
        ModelConfig.from_dict(dict(raw, use_sliding_window=True))
    mixtral = ModelConfig.from_dict(dict(raw, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2,
                                         sliding_window=512))
    assert mixtral.traits.moe.layers == (True,) * 6 and mixtral.traits.moe.intermediate_size == 128 and mixtral.traits.moe.renormalize
    assert mixtral.max_model_len == 512


SHAPE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)


def test_glm4_moe_config_as_published_checkpoints_write_it():
    """GLM-4.5's keys (first_k_dense_replace, n_group, the default half rotary when absent); a
    group shape that cannot hold the top k fails in one line."""
    glm = dict(SHAPE, model_type="glm4_moe", n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
               first_k_dense_replace=2, moe_intermediate_size=24, n_shared_experts=2, routed_scaling_factor=2.5,
               use_qk_norm=False, num_nextn_predict_layers=1)
    config = ModelConfig.from_dict(glm)
    moe = config.traits.moe
    assert moe.layers == (False, False, True, True) and moe.scoring == "sigmoid_topk" and moe.renormalize
    assert (moe.num_groups, moe.topk_groups, moe.routed_scaling_factor) == (4, 2, 2.5)
    assert (moe.shared_intermediate_size, moe.shared_expert_gate) == (48, False)
    assert config.traits.qk_norm is None and config.rotary_dim == 16 and config.traits.num_extra_layers == 1
    assert ModelConfig.from_dict(dict(glm, partial_rotary_factor=0.25)).rotary_dim == 8
    assert ModelConfig.from_dict(dict(glm, first_k_dense_replace=4)).traits.moe is None
    with pytest.raises(ModelConfigError, match="^top 5 experts from topk_group 1 of 4 groups of 4$"):
        ModelConfig.from_dict(dict(glm, topk_group=1, num_experts_per_tok=5))
    with pytest.raises(ModelConfigError, match="16 experts do not split into n_group 3 groups"):
        ModelConfig.from_dict(dict(glm, n_group=3))


def test_minimax_m2_config_reads_rotary_dim():
    minimax = ModelConfig.from_dict(dict(SHAPE, model_type="minimax_m2", num_local_experts=8, rotary_dim=8))
    assert minimax.rotary_dim == 8 and minimax.traits.qk_norm == "projection"
    assert minimax.traits.moe.correction_bias == ("e_score_correction_bias",) and minimax.traits.moe.num_groups == 1


def test_ernie4_5_moe_config_reads_its_moe_layers():
    ernie = dict(SHAPE, model_type="ernie4_5_moe", num_hidden_layers=6, moe_num_experts=8, moe_k=2,
                 moe_layer_start_index=1, moe_layer_end_index=4, moe_layer_interval=2, moe_num_shared_experts=1,
                 moe_intermediate_size=24)
    config = ModelConfig.from_dict(ernie)
    assert config.traits.moe.layers == (False, True, False, True, False, False) and config.traits.rope_interleaved
    assert config.traits.moe.correction_bias[0] == "moe_statics.e_score_correction_bias"
    assert config.traits.moe.shared_intermediate_size == 24 and config.traits.moe.scoring == "softmax_topk"
    assert ModelConfig.from_dict(dict(ernie, moe_layer_end_index=-1)).traits.moe.layers[5]
    with pytest.raises(ModelConfigError, match="use_bias"):
        ModelConfig.from_dict(dict(ernie, use_bias=True))


def test_hunyuan_v1_moe_config_as_published_checkpoints_write_it():
    """Hunyuan-A13B's config: per-layer lists of one value, RoPE "dynamic" with alpha (a fixed base
    theta * alpha ** (d / (d - 2)), no length-dependent scaling); q/k norms after RoPE keep the C loop off."""
    hunyuan = dict(SHAPE, model_type="hunyuan_v1_moe", num_experts=8, moe_topk=[2] * 4,
                   rope_scaling=dict(type="dynamic", alpha=1000.0, factor=1.0), rope_theta=10000.0)
    config = ModelConfig.from_dict(hunyuan)
    assert (config.traits.moe.top_k, config.traits.moe.num_experts, config.traits.qk_norm) == (2, 8, "head_after_rope")
    assert config.rope_scaling.rope_type == "default" and config.rope_theta == 10000.0 * 1000.0 ** (32 / 30)
    assert "q/k norms after RoPE" in config.paths.c_layer_loop
    with pytest.raises(ModelConfigError, match="moe_topk varying between layers"):
        ModelConfig.from_dict(dict(hunyuan, moe_topk=[2, 2, 4, 2]))


def test_llama4_text_config_as_published_checkpoints_write_it():
    """Llama 4 Scout's keys: no_rope_layers (every fourth layer without RoPE), every layer MoE (moe_layers),
    llama3 RoPE, chunked attention on the RoPE layers only, temperature tuning given as a number; Maverick's:
    MoE every other layer (interleave_moe_layer_step), no q/k norm, an empty no_rope_layers (the default);
    a null attention_chunk_size, or layer_types, leaves layers full."""
    scout = dict(SHAPE, model_type="llama4_text", num_hidden_layers=8, intermediate_size_mlp=96, num_local_experts=16,
                 num_experts_per_tok=1, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0] * 2,
                 moe_layers=list(range(8)), rope_theta=5e5, use_qk_norm=True, attn_temperature_tuning=4,
                 floor_scale=8192, attn_scale=0.1,
                 rope_scaling=dict(rope_type="llama3", factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                                   original_max_position_embeddings=8192))
    config = ModelConfig.from_dict(scout)
    traits, moe = config.traits, config.traits.moe
    assert traits.rope_layers == (True, True, True, False) * 2 and traits.rope_interleaved
    assert traits.layer_chunks == (8192, 8192, 8192, None) * 2 and config.layer_chunk(3) is None
    assert traits.query_temperature == (8192.0, 0.1) and traits.qk_norm == "l2_after_rope"
    assert moe.layers == (True,) * 8 and (moe.top_k, moe.scoring, moe.weight_inputs, moe.renormalize) == (
        1, "topk_sigmoid", True, False)
    assert (moe.shared_intermediate_size, moe.shared_expert_gate, config.intermediate_size) == (128, False, 96)
    assert config.rope_scaling.rope_type == "llama3" and config.rope_theta == 5e5
    assert "chunked attention layers" in config.paths.c_layer_loop
    maverick = ModelConfig.from_dict(dict(scout, moe_layers=None, interleave_moe_layer_step=2, use_qk_norm=False,
                                          no_rope_layers=[]))
    assert maverick.traits.moe.layers == (False, True) * 4 and maverick.traits.qk_norm is None
    assert maverick.traits.rope_layers == (True, True, True, False) * 2
    unchunked = ModelConfig.from_dict(dict(scout, attention_chunk_size=None, attn_temperature_tuning=False))
    assert unchunked.traits.layer_chunks is None and unchunked.traits.query_temperature is None
    assert ModelConfig.from_dict(dict(scout, layer_types=["full_attention"] * 8)).traits.layer_chunks is None
    assert ModelConfig.from_dict(dict(scout, moe_layers=[])).traits.moe is None
    with pytest.raises(ModelConfigError, match="layer_types"):
        ModelConfig.from_dict(dict(scout, layer_types=["sliding_attention"] * 8))
    with pytest.raises(ModelConfigError, match="no_rope_layers has 3 entries for 8 layers"):
        ModelConfig.from_dict(dict(scout, no_rope_layers=[1, 1, 0]))


def test_a_multi_token_prediction_layer_is_skipped_and_the_correction_bias_read_in_fp32(tmp_path):
    """GLM-4.5 checkpoints ship a layer past num_hidden_layers (its MTP module), which we do not run;
    a bf16 load keeps e_score_correction_bias in fp32, as transformers does."""
    from workers.loader import layers_not_run, read_safetensors

    model_dir = build_tiny_model_dir(tmp_path / "glm4_moe", **CHECKPOINTS["glm4_moe"])
    tensors = load_file(model_dir / "model.safetensors")
    extra = {name.replace("layers.2.", "layers.3."): tensor for name, tensor in tensors.items() if "layers.2." in name}
    model = load_tensors(model_dir, dict(tensors, **extra, **{"model.layers.3.eh_proj.weight": torch.ones(2, 2)}))
    assert len(model.layers) == 3
    with pytest.raises(WeightError, match="unexpected tensors: model.layers.4."):
        load_tensors(model_dir, dict(tensors, **{name.replace("layers.3.", "layers.4."): t for name, t in extra.items()}))
    with_mtp = build_tiny_model_dir(tmp_path / "with_mtp", **CHECKPOINTS["glm4_moe"])
    save_file(dict(tensors, **{name: t.clone() for name, t in extra.items()}), with_mtp / "model.safetensors",
              metadata={"format": "pt"})
    read = read_safetensors(with_mtp, None, skip=layers_not_run(ModelConfig.from_model_dir(with_mtp)))
    assert set(read) == set(tensors)  # the MTP layer's tensors are never read
    bf16 = read_safetensors(model_dir, torch.bfloat16)
    assert bf16["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert bf16["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_qwen3_next_multi_token_prediction_module_is_skipped(tmp_path):
    """Qwen3-Next checkpoints ship an MTP module beside the model (mtp.*), which we do not run: never
    read from safetensors, and dropped where it reaches the model builder."""
    from workers.loader import layers_not_run, read_safetensors

    model_dir = build_tiny_model_dir(tmp_path / "qwen3_next", **CHECKPOINTS["qwen3_next-full-attention"])
    tensors = load_file(model_dir / "model.safetensors")
    mtp = {"mtp.fc.weight": torch.ones(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)}
    save_file(dict(tensors, **mtp), model_dir / "model.safetensors", metadata={"format": "pt"})
    read = read_safetensors(model_dir, None, skip=layers_not_run(ModelConfig.from_model_dir(model_dir)))
    assert set(read) == set(tensors)
    assert len(load_tensors(model_dir, dict(tensors, **mtp)).layers) == 3
    with pytest.raises(WeightError, match="unexpected tensors: mtpx.fc.weight"):
        load_tensors(model_dir, dict(tensors, **{"mtpx.fc.weight": torch.ones(2, 2)}))


def load_tensors(model_dir, tensors: dict, **kwargs) -> PagedLlamaModel:
    config = ModelConfig.from_model_dir(model_dir)
    if kwargs:
        config = replace(config, traits=replace(config.traits, moe=replace(config.traits.moe, **kwargs)))
    return PagedLlamaModel.from_hf_weights(config, tensors, "cpu", get_attention_backend("torch"), 64)


@pytest.mark.parametrize("layout", ["classic", "fused"])
def test_a_missing_expert_tensor_is_named_on_one_line(tmp_path, layout):
    checkpoint = "mixtral" if layout == "classic" else "mixtral-fused"
    model_dir = build_tiny_model_dir(tmp_path / checkpoint, **CHECKPOINTS[checkpoint])
    tensors = load_file(model_dir / "model.safetensors")
    missing = ("model.layers.1.block_sparse_moe.experts.2.w3.weight" if layout == "classic"
               else "model.layers.1.mlp.experts.down_proj")
    del tensors[missing]
    with pytest.raises(WeightError) as error:
        load_tensors(model_dir, tensors)
    assert str(error.value) == f"missing tensor {missing}"
    save_file(tensors, model_dir / "model.safetensors")  # and through the loader, naming the directory
    with pytest.raises(ModelPathError, match=f"{model_dir}.*missing tensor {missing}") as error:
        make_runner(model_dir)
    assert "\n" not in str(error.value)


def test_a_checkpoint_with_other_experts_than_the_config_is_refused(tmp_path):
    model_dir = build_tiny_model_dir(tmp_path / "mixtral", **CHECKPOINTS["mixtral"])
    tensors = load_file(model_dir / "model.safetensors")
    with pytest.raises(WeightError, match=r"^model.layers.0.block_sparse_moe.gate.weight has shape \(6, 64\), "
                                          r"expected \(5, 64\)$"):
        load_tensors(model_dir, dict(tensors), num_experts=5)
    extra = "model.layers.0.block_sparse_moe.experts.6.w1.weight"
    with pytest.raises(WeightError, match=rf"^2 unexpected tensors: {extra}"):
        load_tensors(model_dir, dict(tensors, **{extra: torch.ones(1),
                                                 "model.layers.2.block_sparse_moe.experts.7.w2.weight": torch.ones(1)}))
