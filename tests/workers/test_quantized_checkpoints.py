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
- a missing or misshapen quantized tensor fails in one line naming the layer and the tensor.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import quant_cases as qc
import torch
from runner_helpers import HfOracle, assert_greedy_matches, greedy, make_runner, prompts_of_lengths, run_requests
from safetensors.torch import load_file, save_file
from tiny_model import build_tiny_model_dir

from workers.loader import ModelPathError, load_model

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")
GROUP = 32

# format -> (quantization_config, (weight, prefix) -> (checkpoint tensors, dequantized weight), /v1/models label)
FORMATS = {
    "awq": (qc.AWQ_CONFIG, lambda w, p: qc.make_awq(*w.shape, GROUP, prefix=p, weight=w), "awq:4bit-g32"),
    "gptq": (qc.GPTQ_CONFIG, lambda w, p: qc.make_gptq(*w.shape, GROUP, prefix=p, weight=w), "gptq:4bit-g32"),
    "gptq-v2-act-order": (
        {**qc.GPTQ_CONFIG, "desc_act": True, "checkpoint_format": "gptq_v2"},
        lambda w, p: qc.make_gptq(*w.shape, GROUP, v1=False, act_order=True, prefix=p, weight=w),
        "gptq:4bit-g32-act-order"),
    "compressed-tensors-fp8": (qc.compressed_tensors_config("channel", "dynamic"),
                               lambda w, p: qc.make_fp8(*w.shape, prefix=p, weight=w),
                               "compressed-tensors:fp8-channel"),
    "compressed-tensors-fp8-static": (
        qc.compressed_tensors_config("tensor", "static"),
        lambda w, p: qc.make_fp8(*w.shape, per_channel=False, input_scale=0.02, prefix=p, weight=w),
        "compressed-tensors:fp8-tensor"),
    "fbgemm_fp8": (qc.FBGEMM_CONFIG, lambda w, p: qc.make_fp8(*w.shape, prefix=p, weight=w), "fbgemm_fp8:fp8-channel"),
}


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    return build_tiny_model_dir(tmp_path_factory.mktemp("plain") / "llama", "llama", seed=3)


def write_checkpoints(plain_dir, root, config: dict, quantize) -> tuple:
    """(quantized dir, dense dir with the reference's dequantized weights, name -> dequantized weight)."""
    quantized_dir, dense_dir = root / "quantized", root / "dense"
    shutil.copytree(plain_dir, quantized_dir)
    shutil.copytree(plain_dir, dense_dir)
    tensors = load_file(plain_dir / "model.safetensors")
    quantized, dense, expected = dict(tensors), dict(tensors), {}
    for name in sorted(tensors):
        if LINEAR.fullmatch(name):
            packed, dequantized = quantize(tensors[name], name.removesuffix(".weight"))
            del quantized[name]
            quantized.update(packed)
            dense[name] = expected[name] = dequantized
            assert not torch.equal(dequantized, tensors[name])  # the quantization changed the weight
    save_file(quantized, quantized_dir / "model.safetensors")
    save_file(dense, dense_dir / "model.safetensors")
    raw = json.loads((quantized_dir / "config.json").read_text())
    raw["quantization_config"] = config
    (quantized_dir / "config.json").write_text(json.dumps(raw))
    return quantized_dir, dense_dir, expected


@pytest.fixture(scope="module", params=sorted(FORMATS))
def checkpoint(request, plain_dir, tmp_path_factory):
    config, quantize, label = FORMATS[request.param]
    return (*write_checkpoints(plain_dir, tmp_path_factory.mktemp(request.param), config, quantize), label)


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
    config, quantize, _ = FORMATS[format_name]
    quantized_dir, _, _ = write_checkpoints(plain_dir, tmp_path, config, quantize)
    rewrite(quantized_dir, change)
    with pytest.raises(ModelPathError) as error:
        load_model(quantized_dir, torch.float32, "cpu", attention_backend="torch")
    message = str(error.value)
    assert words in message and "\n" not in message, message


def test_a_layer_whose_dequantized_shape_does_not_fit_names_the_weight(plain_dir, tmp_path):
    """A self-consistent but wrongly sized layer (fp8 weight of another width) is caught by the model."""
    config, quantize, _ = FORMATS["fbgemm_fp8"]
    quantized_dir, _, _ = write_checkpoints(plain_dir, tmp_path, config, quantize)
    name = "model.layers.1.self_attn.v_proj"
    rewrite(quantized_dir, lambda t: t.update({f"{name}.weight": t[f"{name}.weight"][:16].contiguous(),
                                               f"{name}.weight_scale": t[f"{name}.weight_scale"][:16].contiguous()}))
    with pytest.raises(ModelPathError, match=rf"{re.escape(name)}\.weight has shape \(16, 64\), expected \(32, 64\)"):
        load_model(quantized_dir, torch.float32, "cpu", attention_backend="torch")
