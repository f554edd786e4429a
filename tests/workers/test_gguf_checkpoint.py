"""Serving a GGUF checkpoint natively: its tensors under Hugging Face names with the projections
kept quantized (workers/gguf_checkpoint.py), the model built over them (workers/model.py), and
the selection between that and the dequantized path (workers/loader.serves_gguf).

The default model (SmolLM2-135M-Instruct, Q4_1) is checked against transformers' own GGUF
loading (the converted cache is exactly that), tensor by tensor, and its quantized model's
next-token choices against the dequantized fp32 model's. The products run through the
reference gguf_linear (or whatever kernels workers/gguf_weight.py picks), so positions are few.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pydoc_data.topics
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from workers import model_runner
from workers.config import ModelConfig
from workers.gguf_checkpoint import (
    SUPPORTED_TYPES,
    GgufCheckpointError,
    read_gguf_checkpoint,
    rope_row_order,
    unpermute_rope_rows,
)
from workers.gguf_weight import GgufWeight, GGMLType, dequantize, row_bytes
from workers.kernels import get_attention_backend
from workers.kernels.native import native_available
from workers.layer_ops import TorchOps
from workers.linear import TorchLinear
from workers.loader import (
    ModelPathError,
    find_default_gguf,
    load_weights,
    read_safetensors,
    resolve_model_path,
    serves_gguf,
)
from workers.model import AttentionMetadata, PagedLlamaModel, WeightError
from workers.model_runner import ModelRunner, RunnerConfig

NUM_POSITIONS = 200  # teacher-forced positions of real text (one prefill: the reference products are slow)
MIN_AGREEMENT = 0.99


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    """These tests check the checkpoint's reading and the model's wiring, so the kernels take x in
    fp32 (the same weights give the same tokens up to fp32 sums); the served default quantizes x
    to int8 per block, whose error tests/workers/test_gguf_kernels.py bounds and
    bench/gguf_accuracy.py measures on real text."""
    from workers.kernels import gguf

    monkeypatch.setattr(gguf, "DEFAULT_MODE", "fp32")


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q and k: each head's two halves interleaved."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def quantized(weight: torch.Tensor, ggml_type: GGMLType) -> GgufWeight:
    blocks = quants.quantize(weight.float().numpy(), GGMLQuantizationType(int(ggml_type)))
    return GgufWeight(ggml_type, weight.shape[0], weight.shape[1], torch.from_numpy(np.ascontiguousarray(blocks)))


# --- the q/k row order -------------------------------------------------------------------------


def test_rope_row_order_undoes_llama_cpps_permutation_on_quantized_rows():
    torch.manual_seed(0)
    num_heads, head_dim, width = 3, 8, 64
    hf = torch.randn(num_heads * head_dim, width)
    file_rows = torch.from_numpy(llama_cpp_permute(hf.numpy(), num_heads))
    order = rope_row_order(hf.shape[0], num_heads)
    assert not torch.equal(order, torch.arange(hf.shape[0]))
    assert torch.equal(file_rows[order], hf)
    weight = quantized(file_rows, GGMLType.Q8_0)
    restored = unpermute_rope_rows(weight, num_heads)
    assert restored.ggml_type == GGMLType.Q8_0  # still the file's blocks
    assert torch.equal(dequantize(restored), dequantize(weight)[order])  # whole rows of blocks move: exact
    bias = torch.randn(num_heads * head_dim)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(bias.numpy(), num_heads)), num_heads),
                       bias)


# --- the default model against transformers' GGUF loading --------------------------------------


@pytest.mark.slow
def test_default_gguf_equals_transformers_dequantized_loading_tensor_by_tensor(smollm2_dir):
    checkpoint = read_gguf_checkpoint(find_default_gguf(), torch.float32)
    reference = read_safetensors(smollm2_dir, torch.float32)  # transformers' from_pretrained(gguf_file=...)
    assert checkpoint.architecture == "llama" and checkpoint.quantization == "gguf:Q4_1"
    assert sorted(checkpoint.tensors) == sorted(reference)
    types = {}
    for name, value in checkpoint.tensors.items():
        full = value if isinstance(value, torch.Tensor) else value.dequantize()
        assert full.dtype == torch.float32 and torch.equal(full, reference[name]), name
        types[name] = "plain" if isinstance(value, torch.Tensor) else value.ggml_type.name
    projections = [name for name in types if name.endswith("_proj.weight")]
    assert len(projections) == 210 and all(types[name] == "Q4_1" for name in projections)
    assert types["model.embed_tokens.weight"] == "Q8_0"  # kept quantized: looked up row by row, and the lm_head
    assert sum(kind == "plain" for kind in types.values()) == 61  # the norms
    # the q/k rows really were reordered (the file's order is not transformers')
    from gguf import GGUFReader

    raw = next(t for t in GGUFReader(find_default_gguf()).tensors if t.name == "blk.0.attn_q.weight")
    raw_q = torch.from_numpy(quants.dequantize(np.asarray(raw.data), raw.tensor_type).copy())
    assert not torch.equal(raw_q, reference["model.layers.0.self_attn.q_proj.weight"])


@torch.inference_mode()
def top1_of_one_prefill(model: PagedLlamaModel, token_ids: list[int]) -> torch.Tensor:
    """The model's argmax next token at every position of one sequence (a single prefill)."""
    block_size, num_tokens = 16, len(token_ids)
    c = model.config
    num_blocks = -(-num_tokens // block_size) + 1
    kv_caches = [model.attention.allocate_kv_cache(num_blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype,
                                                   model.device) for _ in range(c.num_layers)]
    positions, metadata = AttentionMetadata.one_sequence(num_tokens, block_size)
    hidden = model.forward(torch.tensor(token_ids), positions, metadata, kv_caches)
    return model.compute_logits(hidden).argmax(dim=-1)


@pytest.mark.slow
def test_quantized_default_model_agrees_with_its_dequantized_fp32_model(smollm2_dir):
    """The same weights (the GGUF's, dequantized or not) up to the order of fp32 sums: the next
    token agrees at (nearly) every position of real text, teacher-forced."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = pydoc_data.topics.topics["assignment"] + pydoc_data.topics.topics["if"]
    token_ids = tokenizer(text)["input_ids"][:NUM_POSITIONS]
    assert len(token_ids) == NUM_POSITIONS
    config = ModelConfig.from_model_dir(smollm2_dir)
    native = load_weights(smollm2_dir, config, torch.float32, gguf_path=find_default_gguf())
    assert native.quantization == "gguf:Q4_1" and native.dtype == torch.float32
    assert native.embed.label.startswith("GGUF") and native.lm_head is native.embed  # tied, kept quantized
    assert all(w.ggml_type == GGMLType.Q4_1
               for layer in native.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    if native_available():  # repacked for our kernels: the Q4_1 layers and the Q8_0 lm_head (and lookups)
        assert all(w.packed for layer in native.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
        assert native.embed.ggml_type == GGMLType.Q8_0 and native.embed.packed
    dequantized = load_weights(smollm2_dir, config, torch.float32)
    ours, reference = top1_of_one_prefill(native, token_ids), top1_of_one_prefill(dequantized, token_ids)
    agreement = (ours == reference).float().mean().item()
    print(f"teacher-forced top-1 agreement, GGUF-native fp32 vs dequantized fp32: {agreement:.4f} "
          f"over {NUM_POSITIONS} positions")
    assert agreement >= MIN_AGREEMENT


@pytest.mark.slow
def test_quantization_auto_serves_the_gguf_and_float32_the_dequantized_weights(smollm2_dir, monkeypatch):
    """quantization auto: dtype auto is fp32 activations over the quantized weights on every CPU
    (one with native bf16 is pretended here, where auto alone would pick bf16); an explicit float32
    is the dequantized model; their greedy tokens agree. auto is the default."""
    from runner_helpers import greedy, run_requests
    from transformers import AutoTokenizer

    monkeypatch.setattr(model_runner, "cpu_has_fast_bf16", lambda: True)
    assert RunnerConfig().quantization == "auto"
    settings = dict(block_size=16, num_blocks=16, attention_backend="torch", quantization="auto")
    native = ModelRunner(RunnerConfig(**settings))
    assert (native.model_info.quantization, native.model_info.dtype) == ("gguf:Q4_1", "float32")
    assert native.model_info.model_path == str(smollm2_dir)  # config and tokenizer: the converted directory
    dequantized = ModelRunner(RunnerConfig(dtype="float32", **settings))
    assert (dequantized.model_info.quantization, dequantized.model_info.dtype) == ("none", "float32")
    in_bf16 = ModelRunner(RunnerConfig(dtype="bfloat16", **settings))  # explicit bf16: bf16 activations
    assert (in_bf16.model_info.quantization, in_bf16.model_info.dtype) == ("gguf:Q4_1", "bfloat16")
    del in_bf16
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer(text)["input_ids"] for text in ("The capital of France is", "def fibonacci(n):")]
    assert run_requests(native, prompts, greedy(6)) == run_requests(dequantized, prompts, greedy(6))


def test_selection_between_native_and_dequantized():
    assert serves_gguf("auto", "auto", "cpu") and serves_gguf("auto", "bfloat16", "cpu")
    assert not serves_gguf("auto", "float32", "cpu")  # the exact dequantized path of the oracle tests
    assert not serves_gguf("none", "auto", "cpu") and not serves_gguf("none", "bfloat16", "cpu")
    assert not serves_gguf("auto", "auto", "cuda")  # GGUF products are CPU kernels
    with pytest.raises(ValueError, match="unknown quantization 'q4'"):
        serves_gguf("q4", "auto", "cpu")


# --- the model over GGUF weights (a tiny random Llama) -----------------------------------------


def tiny_weights(tiny_model_dir, types: dict[str, GGMLType]) -> tuple[ModelConfig, dict, dict]:
    """The tiny model's config, its tensors with the named ones quantized (by suffix), and the same
    tensors with those quantized weights dequantized again (what the dequantized path reads)."""
    config = ModelConfig.from_model_dir(tiny_model_dir)
    tensors = read_safetensors(tiny_model_dir, torch.float32)
    gguf, plain = {}, {}
    for name, tensor in tensors.items():
        kind = next((t for suffix, t in types.items() if name.endswith(suffix)), None)
        gguf[name] = quantized(tensor, kind) if kind is not None else tensor
        plain[name] = dequantize(gguf[name]) if kind is not None else tensor
    return config, gguf, plain


def build(config, tensors) -> PagedLlamaModel:
    return PagedLlamaModel.from_hf_weights(config, tensors, device="cpu", attention=get_attention_backend("torch"),
                                           max_positions=64, linear=TorchLinear(), ops=TorchOps())


def test_model_over_gguf_weights_equals_the_dequantized_model(tiny_model_dir, caplog):
    types = {"q_proj.weight": GGMLType.Q8_0, "k_proj.weight": GGMLType.Q4_0, "v_proj.weight": GGMLType.Q8_0,
             "o_proj.weight": GGMLType.Q4_1, "gate_proj.weight": GGMLType.Q4_0, "up_proj.weight": GGMLType.Q4_0,
             "down_proj.weight": GGMLType.Q8_0, "embed_tokens.weight": GGMLType.Q8_0}
    config, gguf, plain = tiny_weights(tiny_model_dir, types)
    config = dataclasses.replace(config, tie_word_embeddings=True)  # the lm_head is the quantized embedding
    with caplog.at_level(logging.WARNING, logger="workers.model"):
        native = build(config, gguf)
    # q, k, v of two types: that product is dequantized, and one warning names it per layer
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "3 fused products mix quantized types" in warnings[0]
    assert "model.layers.0.self_attn.q_proj (GGUF Q8_0) + model.layers.0.self_attn.k_proj (GGUF Q4_0)" in warnings[0]
    layer = native.layers[0]
    assert isinstance(layer.qkv, torch.Tensor) and layer.qkv.dtype == torch.float32
    assert layer.gate_up.ggml_type == GGMLType.Q4_0  # one type: concatenated
    assert layer.o.label.startswith("GGUF") and layer.down.label.startswith("GGUF")
    assert native.lm_head is native.embed and native.dtype == torch.float32  # tied
    reference = build(config, plain)
    token_ids = list(range(3, 40))
    assert torch.equal(top1_of_one_prefill(native, token_ids), top1_of_one_prefill(reference, token_ids))
    ids = torch.tensor([5, 7, 5, 300])
    assert torch.equal(native.embed_tokens(ids), reference.embed_tokens(ids))  # the rows, dequantized one by one


def test_model_refuses_to_fold_a_residual_multiplier_into_gguf_weights(tiny_model_dir):
    config, gguf, _ = tiny_weights(tiny_model_dir, {"o_proj.weight": GGMLType.Q8_0})
    with pytest.raises(WeightError, match="residual multiplier 0.5 cannot be folded into a GGUF Q8_0 weight"):
        build(dataclasses.replace(config, traits=dataclasses.replace(config.traits, residual_multiplier=0.5)), gguf)


def test_misshapen_gguf_weight_is_named(tiny_model_dir):
    config, gguf, _ = tiny_weights(tiny_model_dir, {"up_proj.weight": GGMLType.Q8_0})
    name = "model.layers.1.mlp.up_proj.weight"
    gguf[name] = gguf[name].rows(slice(0, 32))
    with pytest.raises(WeightError, match=f"{name} has shape \\(32, 64\\), expected"):
        build(config, gguf)


# --- files we refuse -----------------------------------------------------------------------------


def write_gguf(path, architecture: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]):
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    for name, (data, raw_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_tensor_type_fails_naming_tensor_type_and_the_supported_ones(tmp_path):
    q5_0_rows = np.zeros((8, 22 * 2), dtype=np.uint8)  # 8 rows of 64 weights: two 22-byte Q5_0 blocks each
    path = write_gguf(tmp_path / "q5.gguf", "llama", {
        "blk.0.attn_norm.weight": (np.ones(64, dtype=np.float32), None),
        "blk.0.attn_q.weight": (q5_0_rows, GGMLQuantizationType.Q5_0),
    })
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    with pytest.raises(GgufCheckpointError) as error:
        read_gguf_checkpoint(path, torch.float32)
    message = str(error.value)
    assert "\n" not in message
    assert f"tensor blk.0.attn_q.weight has GGUF type Q5_0, which is not supported; supported: {supported}" in message
    assert "Q4_1" in supported and "Q6_K" in supported


def test_unsupported_architecture_fails_at_start_naming_it(tmp_path):
    path = write_gguf(tmp_path / "qwen.gguf", "qwen2", {"blk.0.attn_norm.weight": (np.ones(64, np.float32), None)})
    with pytest.raises(GgufCheckpointError, match="GGUF architecture 'qwen2' is not supported; supported: llama"):
        read_gguf_checkpoint(path, torch.float32)
    # a .gguf model path is checked before anything is converted (the cache stays empty)
    cache = tmp_path / "cache"
    with pytest.raises(ModelPathError, match="GGUF architecture 'qwen2' is not supported"):
        resolve_model_path(str(path), cache)
    assert not cache.exists() or not any(cache.iterdir())


def test_tensor_without_a_place_in_the_model_is_named(tmp_path):
    path = write_gguf(tmp_path / "moe.gguf", "llama", {
        "blk.0.ffn_gate_exps.weight": (np.ones((2, 4, 64), np.float32), None)})
    with pytest.raises(GgufCheckpointError, match="tensor blk.0.ffn_gate_exps.weight has no place in a llama model"):
        read_gguf_checkpoint(path, torch.float32)


def test_missing_gguf_file_is_named(tmp_path):
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(ModelPathError, match=f"{missing} does not exist or is not a file"):
        resolve_model_path(str(missing), tmp_path / "cache")


def test_a_gguf_path_is_converted_once_under_its_stem(tmp_path, monkeypatch):
    from workers import loader
    from workers.loader import gguf_source

    path = write_gguf(tmp_path / "my-model.Q4_1.gguf", "llama",
                      {"blk.0.attn_norm.weight": (np.ones(64, np.float32), None)})
    converted = []

    def convert(gguf_path, out_dir):
        converted.append(gguf_path)
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(loader, "convert_gguf", convert)
    cache = tmp_path / "cache"
    model_dir = resolve_model_path(str(path), cache)
    assert model_dir.name == "my-model.Q4_1" and model_dir.parent.parent == cache  # the served name: the stem
    assert resolve_model_path(str(path), cache) == model_dir and converted == [path]  # once
    assert gguf_source(str(path)) == path and gguf_source(str(tmp_path)) is None


def test_app_argument_quantization():
    from pydantic import ValidationError

    from serve_app.config import AppArgs

    assert AppArgs().quantization == "auto" and AppArgs(quantization="none").quantization == "none"
    with pytest.raises(ValidationError):
        AppArgs(quantization="q4_1")


def test_every_served_type_is_read_as_blocks_or_plain_tensor(tmp_path):
    rng = np.random.default_rng(0)
    width = 256  # one K-quant block per row
    tensors, expected_blocks = {}, {}
    for layer, ggml_type in enumerate((GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K,
                                       GGMLType.Q6_K)):
        blocks = rng.integers(0, 256, size=(8, row_bytes(ggml_type, width)), dtype=np.uint8)
        tensors[f"blk.{layer}.ffn_up.weight"] = (blocks, GGMLQuantizationType(int(ggml_type)))
        expected_blocks[f"model.layers.{layer}.mlp.up_proj.weight"] = (ggml_type, blocks)
    q = rng.standard_normal((8, width)).astype(np.float32)
    k = rng.standard_normal((8, width)).astype(np.float32)
    tensors["blk.0.attn_q.weight"] = (llama_cpp_permute(q, 2).astype(np.float16), None)
    tensors["blk.0.attn_k.weight"] = (quants.quantize(llama_cpp_permute(k, 2), GGMLQuantizationType.BF16),
                                      GGMLQuantizationType.BF16)
    checkpoint = read_gguf_checkpoint(write_gguf(tmp_path / "types.gguf", "llama", tensors), torch.bfloat16)
    for name, (ggml_type, blocks) in expected_blocks.items():
        weight = checkpoint.tensors[name]
        assert weight.ggml_type == ggml_type and weight.shape == (8, width)
        assert torch.equal(weight.blocks, torch.from_numpy(blocks))  # the file's bytes, untouched
    q_read, k_read = (checkpoint.tensors[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qk")
    assert q_read.dtype == k_read.dtype == torch.bfloat16  # plain projections: the model's dtype
    torch.testing.assert_close(q_read.float(), torch.from_numpy(q), atol=2e-2, rtol=1e-2)  # F16 then bf16 rounding
    torch.testing.assert_close(k_read.float(), torch.from_numpy(k), atol=2e-2, rtol=1e-2)
