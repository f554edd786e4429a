"""Quantized safetensors checkpoints (fp8 from compressed-tensors and fbgemm_fp8, awq, gptq)
through our loader, dequantized at load (workers/quant_checkpoint.py).

For each format a tiny random llama checkpoint has every projection weight quantized by the
reference quantizers of tests/quant_cases.py (written from the formats' own descriptions,
independently of workers/quant_formats.py), stored under the format's tensor names with its
quantization_config in config.json, as the format's writer does. Beside it, a plain checkpoint
holds the reference's dequantized weights. Then:
- every layer of our model (fp32) holds exactly the reference's dequantized weight, and in bf16
  that weight rounded once;
- our greedy tokens equal transformers' own model on the dequantized checkpoint;
- /v1/models' backend.quantization (ModelInfo.quantization) names the format;
- a missing or misshapen quantized tensor fails in one line naming the layer and the tensor;
- the CUDA path's model (pack_checkpoint: the quantized linears kept kernel-ready, fused q/k/v and
  gate/up stacked in their format, multiplied by triton_quant.quant_linear) run on CPU tensors in
  Triton's interpreter gives transformers' greedy tokens too (4-bit formats and weights-only fp8;
  fp8 with quantized activations is covered by the kernel tests of test_triton_quant.py only).
  The interpreter is switched on as in test_triton_quant.py (before triton's first import, on a
  machine without CUDA); where triton was imported compiled first, these tests skip.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
import quant_cases as qc
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: see the module docstring
from runner_helpers import HfOracle, assert_greedy_matches, greedy, make_runner, prompts_of_lengths, run_requests
from safetensors.torch import load_file, save_file
from tiny_model import build_tiny_model_dir

from workers.config import ModelConfig
from workers.loader import ModelPathError, load_model
from workers.quant_formats import Fp8Weight, Int4Weight


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("plain") / "llama", "llama", seed=3)


@pytest.fixture(scope="module", params=sorted(qc.CHECKPOINT_FORMATS))
def checkpoint(request, plain_dir, tmp_path_factory):
    config, quantize, label = qc.CHECKPOINT_FORMATS[request.param]
    return (*qc.write_checkpoints(plain_dir, tmp_path_factory.mktemp(request.param), config, quantize), label)


def layer_weights(model, index: int) -> dict[str, torch.Tensor]:
    """Our layer's (fused) projection weights (torch linear backend: plain tensors)."""
    layer = model.layers[index]
    return {"qkv": layer.qkv, "o": layer.o, "gate_up": layer.gate_up, "down": layer.down}


def expected_layer(expected: dict, index: int) -> dict[str, torch.Tensor]:
    attn, mlp = f"model.layers.{index}.self_attn.", f"model.layers.{index}.mlp."
    return {"qkv": torch.cat([expected[attn + p + "_proj.weight"] for p in "qkv"]),
            "o": expected[attn + "o_proj.weight"],
            "gate_up": torch.cat([expected[mlp + p + "_proj.weight"] for p in ("gate", "up")]),
            "down": expected[mlp + "down_proj.weight"]}


def test_every_layer_holds_the_dequantized_weight(checkpoint):
    quantized_dir, _, expected, label = checkpoint
    config, model = load_model(quantized_dir, torch.float32, "cpu", attention_backend="torch", linear_backend="torch")
    assert model.quantization == f"{label} (dequantized at load)"
    assert config.quant_spec.label == label
    for index in range(config.num_layers):
        ours, reference = layer_weights(model, index), expected_layer(expected, index)
        for key in ours:
            assert ours[key].dtype == torch.float32
            assert torch.equal(ours[key], reference[key]), f"layer {index} {key}"


def test_bf16_rounds_the_dequantized_weight_once(checkpoint):
    quantized_dir, _, expected, _ = checkpoint
    config, model = load_model(quantized_dir, torch.bfloat16, "cpu", attention_backend="torch", linear_backend="torch")
    reference = expected_layer(expected, config.num_layers - 1)
    for key, ours in layer_weights(model, config.num_layers - 1).items():
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, reference[key].to(torch.bfloat16)), key
    assert model.final_norm.dtype == torch.bfloat16  # the unquantized tensors are cast too


def test_greedy_equals_transformers_on_the_dequantized_weights(checkpoint):
    quantized_dir, dense_dir, _, label = checkpoint
    runner = make_runner(quantized_dir)
    assert runner.model_info.quantization == f"{label} (dequantized at load)"  # /v1/models' backend.quantization
    oracle = HfOracle(dense_dir)
    prompts = prompts_of_lengths([4, 19], runner.model_info.vocab_size, seed=7)
    for prompt, output in zip(prompts, run_requests(runner, prompts, greedy(8), token_budget=16)):
        assert_greedy_matches(output, oracle.greedy(prompt, 8))


def rewrite(model_dir, change) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors")


@pytest.mark.parametrize(("format_name", "change", "words"), [
    ("awq", lambda t: t.pop("model.layers.1.mlp.down_proj.scales"),
     "awq checkpoint lacks model.layers.1.mlp.down_proj.scales"),
    ("awq", lambda t: t.update({"model.layers.0.self_attn.k_proj.qzeros":
                                t["model.layers.0.self_attn.k_proj.qzeros"][:1].contiguous()}),
     "model.layers.0.self_attn.k_proj: awq shapes do not fit: qweight (64, 4), qzeros (1, 4)"),
    ("gptq", lambda t: t.update({"model.layers.2.mlp.gate_proj.qweight":
                                 t["model.layers.2.mlp.gate_proj.qweight"].float()}),
     "model.layers.2.mlp.gate_proj: gptq qweight is torch.float32, expected torch.int32"),
    ("compressed-tensors-fp8", lambda t: t.pop("model.layers.0.self_attn.o_proj.weight_scale"),
     "compressed-tensors checkpoint lacks model.layers.0.self_attn.o_proj.weight_scale"),
    ("fbgemm_fp8", lambda t: t.update({"model.layers.0.mlp.up_proj.weight_scale":
                                       t["model.layers.0.mlp.up_proj.weight_scale"][:5].contiguous()}),
     "model.layers.0.mlp.up_proj: fp8 weight_scale has 5 values for 128 output rows"),
])
def test_missing_or_misshapen_tensors_fail_in_one_line(plain_dir, tmp_path, format_name, change, words):
    config, quantize, _ = qc.CHECKPOINT_FORMATS[format_name]
    quantized_dir, _, _ = qc.write_checkpoints(plain_dir, tmp_path, config, quantize)
    rewrite(quantized_dir, change)
    with pytest.raises(ModelPathError) as error:
        load_model(quantized_dir, torch.float32, "cpu", attention_backend="torch")
    message = str(error.value)
    assert words in message and "\n" not in message, message


def test_a_layer_whose_dequantized_shape_does_not_fit_names_the_weight(plain_dir, tmp_path):
    """A self-consistent but wrongly sized layer (fp8 weight of another width) is caught by the model."""
    config, quantize, _ = qc.CHECKPOINT_FORMATS["fbgemm_fp8"]
    quantized_dir, _, _ = qc.write_checkpoints(plain_dir, tmp_path, config, quantize)
    name = "model.layers.1.self_attn.v_proj"
    rewrite(quantized_dir, lambda t: t.update({f"{name}.weight": t[f"{name}.weight"][:16].contiguous(),
                                               f"{name}.weight_scale": t[f"{name}.weight_scale"][:16].contiguous()}))
    with pytest.raises(ModelPathError, match=rf"{re.escape(name)}\.weight has shape \(16, 64\), expected \(32, 64\)"):
        load_model(quantized_dir, torch.float32, "cpu", attention_backend="torch")


# ----------------------------------------------------------------------------- the CUDA path, interpreted


@pytest.fixture(scope="module")
def interpreted_quant_linear():
    """workers.kernels.triton_quant.quant_linear imported under TRITON_INTERPRET=1 (sys.modules restored)."""
    triton = pytest.importorskip("triton", reason="triton is not installed: the kernel path is not tested")
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.zeros, InterpretedFunction):
        pytest.skip("triton was imported compiled before this module: the interpreter cannot run in this process")
    from triton_interpreter import import_interpreted

    module = import_interpreted("workers.kernels.triton_quant")
    assert isinstance(module._int4_gemm_kernel, InterpretedFunction)
    return module.quant_linear


@pytest.mark.parametrize("format_name", sorted(qc.KERNEL_CHECKPOINT_FORMATS))
def test_kernel_path_in_the_interpreter_equals_transformers(plain_dir, tmp_path, format_name, interpreted_quant_linear):
    config, quantize, _ = qc.KERNEL_CHECKPOINT_FORMATS[format_name]
    quantized_dir, dense_dir, _ = qc.write_checkpoints(plain_dir, tmp_path, config, quantize)
    runner = make_runner(quantized_dir, linear_backend="torch", layer_ops="torch")
    qc.use_packed_model_on_cpu(runner, quantized_dir, interpreted_quant_linear)  # what a CUDA worker builds
    kind = Fp8Weight if format_name.startswith("compressed") else Int4Weight
    fused_kind = torch.Tensor if format_name.endswith("per-projection") else kind
    for layer in runner.model.layers:
        assert isinstance(layer.qkv, fused_kind) and isinstance(layer.gate_up, fused_kind)
        assert isinstance(layer.o, kind) and isinstance(layer.down, kind)
    assert runner.model.layers[0].qkv.shape == (64 + 2 * 32, 64)  # q, k and v stacked
    oracle = HfOracle(dense_dir)
    prompts = prompts_of_lengths([5, 18], runner.model_info.vocab_size, seed=9)
    for prompt, output in zip(prompts, run_requests(runner, prompts, greedy(6), token_budget=16)):
        assert_greedy_matches(output, oracle.greedy(prompt, 6))


def test_stacked_keeps_the_format_or_declines():
    from workers.quant_formats import dequantize, parse_quantization, to_kernel_form

    def kernel_form(config, tensors):
        spec = parse_quantization(config)
        raw = {role.rstrip("?"): tensors.get(name) for role, name in spec.tensor_names("layer").items()}
        return to_kernel_form(spec, {**raw, "bias": None}, "cpu", torch.float32)

    awq = [kernel_form(qc.AWQ_CONFIG, qc.make_awq(n, 64, qc.CHECKPOINT_GROUP, seed=n)[0]) for n in (16, 8, 24)]
    fused = awq[0].stacked(awq)
    assert fused.shape == (48, 64) and torch.equal(dequantize(fused), torch.cat([dequantize(w) for w in awq]))
    fp8 = [kernel_form(qc.compressed_tensors_config("tensor", None), qc.make_fp8(n, 64, per_channel=False, seed=n)[0])
           for n in (16, 8)]
    assert torch.equal(dequantize(fp8[0].stacked(fp8)), torch.cat([dequantize(w) for w in fp8]))  # scales expanded
    act_order = {**qc.GPTQ_CONFIG, "desc_act": True}
    orders = [kernel_form(act_order, qc.make_gptq(8, 64, qc.CHECKPOINT_GROUP, act_order=True, seed=seed)[0]) for seed in (1, 2)]
    assert orders[0].stacked(orders) is None  # different g_idx: the model dequantizes such a product
    static = [kernel_form(qc.compressed_tensors_config("tensor", "static"),
                          qc.make_fp8(8, 64, per_channel=False, input_scale=scale)[0]) for scale in (0.01, 0.02)]
    assert static[0].stacked(static) is None  # different static input scales
    assert awq[0].stacked([awq[0], fp8[0]]) is None and fp8[0].stacked([awq[0], fp8[0]]) is None


def test_which_workers_keep_the_weights_packed():
    from workers.loader import serves_packed

    raw = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, quantization_config=qc.AWQ_CONFIG)
    awq = ModelConfig.from_dict(raw)
    assert not serves_packed(awq, "cpu")  # CPU: always dequantized at load
    triton_installed = importlib.util.find_spec("triton") is not None
    assert serves_packed(awq, "cuda:0") == triton_installed  # decided from the config alone: no GPU needed
    granite = ModelConfig.from_dict(dict(raw, model_type="granite", residual_multiplier=0.5))
    assert granite.traits.residual_multiplier == 0.5 and not serves_packed(granite, "cuda")
    mixtral = ModelConfig.from_dict(dict(raw, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2))
    assert mixtral.traits.moe is not None and not serves_packed(mixtral, "cuda")
