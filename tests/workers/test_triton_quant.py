"""Quantized checkpoints (workers/quant_formats.py) and their Triton kernels
(workers/kernels/triton_quant.py), the kernels in Triton's interpreter on CPU tensors.

Formats: quantization_config parsing and its one-line refusals; the pack/unpack round trip of
every format (tests/quant_cases.py quantizes random weights and packs them as the checkpoint
tools do; load_quantized_linear on CPU must give back exactly the expected dense weight); the
bit layouts on hand-written words.

Kernels: each against its torch dequantize-then-matmul in float64, M in {1, 16, 33}, N = 40 (a
multiple of 8 but not of the 16-wide test tiles), K a multiple of the group size.

The interpreter is switched on as in tests/workers/test_triton_moe.py (see there): set before
triton's first import on a machine without CUDA, the kernel module imported privately under it,
else one child pytest reruns this file interpreted.

What the interpreter cannot show, and the fixtures here stand in for (each for its tests only):
- bf16 (bf16_interpreter, as in test_triton_moe.py): its tl.dot multiplies bf16 bit patterns as
  integers, and its fp32 -> bf16 cast truncates.
- fp32 -> float8_e4m3fn casts (fp8_cast_interpreter): the interpreter drops the carry when
  rounding the mantissa up crosses a power of two (124.06 becomes 64, not 128; a GPU's cvt gives
  128), and flushes e4m3 subnormals to zero. test_interpreter_fp8_cast_is_wrong_without_the_patch
  records the bug; the patch casts through torch (round to nearest even, as the GPU does).
- torch._scaled_mm (sm_89+): not run here at all; tests/gpu/test_gpu_quant.py covers it.
fp8 loads, stores and the byte -> fp16 decode of _fp8_gemm_kernel run unpatched.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import: see the module docstring
triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]'): kernel tests skipped")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton_interpreter import import_interpreted, patch_bf16_like_a_gpu, run_file_in_interpreter  # noqa: E402
import triton.language.standard  # noqa: E402

import quant_cases as qc  # noqa: E402  (tests/quant_cases.py)
from workers import quant_formats as qf  # noqa: E402

IN_PROCESS = isinstance(triton.language.standard.zeros, InterpretedFunction)
NOT_IN_PROCESS_REASON = (
    "triton was imported compiled before this module (or a GPU is present), so the interpreter "
    "cannot run in this process: test_quant_kernels_in_interpreter_subprocess runs these tests instead"
)
N = 40
TILES = (16, 16, 32)  # (BLOCK_M, BLOCK_N, BLOCK_K)
# the 4-bit and MXFP4 GEMMs' two ways to read packed weights (triton_quant.Tiles: ..., num_warps,
# num_stages, packed_loads): a load per weight, or each word (byte) once and unpacked in registers,
# with K tiles of one group (32) and of two (64: act-order, groups of 32, and MXFP4's scale pairs);
# one-row tiles (any M: a program a row) multiply without tl.dot
INT4_TILES = {"per-weight": TILES, "packed-32": (16, 16, 32, 4, 3, True), "packed-64": (16, 16, 64, 4, 3, True),
              "gemv-packed-32": (1, 16, 32, 4, 3, True), "gemv-64": (1, 16, 64)}  # BLOCK_M 1: no tl.dot
MS = (1, 16, 33)
REL_TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}  # of the largest |result|


# ----------------------------------------------------------------------------- interpreter fixtures


@pytest.fixture(scope="module")
def tq():
    """workers.kernels.triton_quant imported under TRITON_INTERPRET=1 (sys.modules restored)."""
    if not IN_PROCESS:
        pytest.skip(NOT_IN_PROCESS_REASON)
    module = import_interpreted("workers.kernels.triton_quant")
    assert isinstance(module._int4_gemm_kernel, InterpretedFunction)
    return module


def test_quant_kernels_in_interpreter_subprocess():
    if IN_PROCESS:
        pytest.skip("the interpreter runs in this process: the tests below ran here")
    run_file_in_interpreter(__file__)


@pytest.fixture(params=sorted(INT4_TILES))
def tiles(request):
    return INT4_TILES[request.param]


@pytest.fixture
def bf16_interpreter(monkeypatch):
    """bf16 tl.dot operands widened to fp32 (exact); fp32 -> bf16 casts rounded to nearest even."""
    patch_bf16_like_a_gpu(monkeypatch)


@pytest.fixture
def fp8_cast_interpreter(monkeypatch):
    """fp32 -> float8_e4m3fn casts through torch (round to nearest even, subnormals kept), as on a GPU."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.float8e4nv:
            return original(self, src, dst_type, rounding_mode)
        cast = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.float8_e4m3fn)
        return interpreter.TensorHandle(cast.view(torch.uint8).numpy(), tl.float8e4nv)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)


def assert_near(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, tol: float | None = None) -> None:
    err, scale = (out.double() - expected.double()).abs().max().item(), expected.abs().max().item()
    tol = REL_TOL[dtype] if tol is None else tol
    assert err <= tol * scale, f"max abs error {err:.3g} > {tol} x {scale:.3g} ({dtype})"


def load(config: dict, tensors: dict, device: str = "cpu", dtype=torch.float32, prefix: str = "layer"):
    return qf.load_quantized_linear(qf.parse_quantization(config), tensors, prefix, device, dtype)


def kernel_weight(config: dict, tensors: dict, dtype=torch.float32, prefix: str = "layer"):
    """The kernel-ready form (as on CUDA) of CPU tensors."""
    spec = qf.parse_quantization(config)
    raw = {role.rstrip("?"): tensors.get(name) for role, name in spec.tensor_names(prefix).items()}
    raw["bias"] = tensors.get(f"{prefix}.bias")
    return qf.to_kernel_form(spec, raw, "cpu", dtype)


def x_for(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ----------------------------------------------------------------------------- parsing


def test_parse_each_supported_method():
    awq = qf.parse_quantization(qc.AWQ_CONFIG)
    assert (awq.method, awq.group_size, awq.zero_offset) == ("awq", 32, 0)
    gptq = qf.parse_quantization(qc.GPTQ_CONFIG)
    assert (gptq.method, gptq.zero_offset, gptq.desc_act) == ("gptq", 1, False)
    assert qf.parse_quantization({**qc.GPTQ_CONFIG, "checkpoint_format": "gptq_v2"}).zero_offset == 0
    assert qf.parse_quantization({**qc.GPTQ_CONFIG, "group_size": -1}).group_size is None
    assert qf.parse_quantization({**qc.GPTQ_CONFIG, "desc_act": True}).desc_act
    fbgemm = qf.parse_quantization(qc.FBGEMM_CONFIG)
    assert (fbgemm.method, fbgemm.activations, fbgemm.activation_scale_ub) == ("fp8", "dynamic_token", 1200.0)
    ct = qf.parse_quantization(qc.compressed_tensors_config("tensor", "static"))
    assert (ct.method, ct.weight_strategy, ct.activations) == ("fp8", "tensor", "static_tensor")
    assert qf.parse_quantization(qc.compressed_tensors_config("channel", None)).activations is None
    assert qf.parse_quantization(qc.MXFP4_CONFIG).method == "mxfp4"
    assert qf.parse_quantization(None) is None


def test_unquantized_modules():
    ct = qf.parse_quantization({**qc.compressed_tensors_config(), "ignore": ["lm_head", "re:.*mlp\\.gate$"]})
    assert not ct.quantizes("lm_head") and not ct.quantizes("model.layers.3.mlp.gate")
    assert ct.quantizes("model.layers.3.mlp.gate_proj") and ct.quantizes("model.layers.0.self_attn.q_proj")
    mx = qf.parse_quantization(qc.MXFP4_CONFIG)
    assert not mx.quantizes("model.layers.7.self_attn.q_proj") and mx.quantizes("model.layers.7.mlp.experts.down_proj")
    assert not qf.parse_quantization(qc.FBGEMM_CONFIG).quantizes("lm_head")
    assert qf.parse_quantization(qc.AWQ_CONFIG).tensor_names("p") == {
        "qweight": "p.qweight", "qzeros": "p.qzeros", "scales": "p.scales"}
    assert qf.parse_quantization(qc.GPTQ_CONFIG).tensor_names("p")["g_idx?"] == "p.g_idx"
    assert qf.parse_quantization(qc.compressed_tensors_config("tensor", "static")).tensor_names("p") == {
        "weight": "p.weight", "weight_scale": "p.weight_scale", "input_scale": "p.input_scale"}
    assert qf.parse_quantization(qc.MXFP4_CONFIG).tensor_names("e.down_proj") == {
        "blocks": "e.down_proj_blocks", "scales": "e.down_proj_scales"}


@pytest.mark.parametrize(("config", "words"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes': not supported"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size 100"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "pack_dtype": "int16"}, "'int16'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({**qc.compressed_tensors_config(), "format": "pack-quantized"}, "'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}, "'block'"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "4 bits"),
])
def test_unsupported_configs_fail_in_one_line(config, words):
    with pytest.raises(qf.QuantConfigError) as error:
        qf.parse_quantization(config)
    message = str(error.value)
    assert words in message and "\n" not in message
    assert "supported: " in message and "awq" in message and "mxfp4" in message


# ----------------------------------------------------------------------------- layouts and round trips


def test_awq_and_gptq_nibble_orders_on_a_hand_written_word():
    word = torch.tensor([[0x76543210]], dtype=torch.int32)  # nibble i holds the value i
    scales = torch.ones(1, 8, dtype=torch.float16)
    awq = qf.Int4Weight("awq", word, torch.zeros(1, 1, dtype=torch.int32), scales, 1, 0, None, None)
    q, _ = qf.unpack_int4(awq)
    assert q.tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]  # column j holds the nibble that AWQ packed it into
    gptq = qf.Int4Weight("gptq", word.expand(1, 8).contiguous(), torch.tensor([[0x00000007]], dtype=torch.int32),
                         scales, 8, 1, None, None)
    q, zeros = qf.unpack_int4(gptq)
    assert q[:, 0].tolist() == list(range(8))  # input rows 0..7 of column 0
    assert zeros.tolist() == [[8, 1, 1, 1, 1, 1, 1, 1]]  # v1: stored zero + 1
    # a negative word (top nibble >= 8) unpacks unsigned
    assert qf.unpack_int4(qf.Int4Weight("gptq", torch.tensor([[-1] * 8], dtype=torch.int32), gptq.qzeros, scales,
                                        8, 0, None, None))[0].unique().tolist() == [15]


@pytest.mark.parametrize("case", ["awq", "gptq-v1", "gptq-v1-sym", "gptq-v2", "gptq-act-order", "gptq-channel",
                                  "mxfp4", "fp8-channel", "fp8-tensor", "fbgemm"])
def test_pack_round_trip_on_cpu(case, caplog):
    """Quantize, pack as the checkpoint does, load on CPU: exactly the expected dense weight."""
    k = 96
    config, (tensors, expected) = {
        "awq": (qc.AWQ_CONFIG, qc.make_awq(N, k, 32)),
        "gptq-v1": (qc.GPTQ_CONFIG, qc.make_gptq(N, k, 32)),
        "gptq-v1-sym": ({**qc.GPTQ_CONFIG, "sym": True}, qc.make_gptq(N, k, 32, sym=True)),
        "gptq-v2": ({**qc.GPTQ_CONFIG, "checkpoint_format": "gptq_v2"}, qc.make_gptq(N, k, 32, v1=False)),
        "gptq-act-order": ({**qc.GPTQ_CONFIG, "desc_act": True}, qc.make_gptq(N, k, 32, act_order=True)),
        "gptq-channel": ({**qc.GPTQ_CONFIG, "group_size": -1}, qc.make_gptq(N, k, k)),
        "mxfp4": (qc.MXFP4_CONFIG, qc.make_mxfp4(N, k)),
        "fp8-channel": (qc.compressed_tensors_config("channel"), qc.make_fp8(N, k)),
        "fp8-tensor": (qc.compressed_tensors_config("tensor"), qc.make_fp8(N, k, per_channel=False)),
        "fbgemm": (qc.FBGEMM_CONFIG, qc.make_fp8(N, k)),
    }[case]
    assert expected.abs().max() > 0
    with caplog.at_level(logging.INFO, logger="workers.quant_formats"):
        qf._CPU_NOTED.clear()
        dense = load(config, tensors, dtype=torch.float32)
        load(config, tensors, dtype=torch.float32)
    assert dense.shape == (N, k) and dense.dtype == torch.float32
    assert torch.equal(dense, expected)
    assert len([r for r in caplog.records if "CPU path dequantizes" in r.getMessage()]) == 1
    assert torch.equal(qf.dequantize(kernel_weight(config, tensors)), expected)
    assert load(config, tensors, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_mxfp4_expert_stack_and_gpt_oss_dequantize():
    tensors, expected = qc.make_mxfp4(N, 64, experts=3, prefix="model.layers.0.mlp.experts.down_proj")
    stacked = kernel_weight(qc.MXFP4_CONFIG, tensors, prefix="model.layers.0.mlp.experts.down_proj")
    assert stacked.blocks.shape == (3, N, 32) and stacked.shape == (N, 64)
    for e in range(3):
        assert torch.equal(qf.dequantize(stacked.expert(e)), expected[e])
    from workers.mxfp4 import dequantize_mxfp4
    assert torch.equal(dequantize_mxfp4(tensors["model.layers.0.mlp.experts.down_proj_blocks"],
                                        tensors["model.layers.0.mlp.experts.down_proj_scales"]), expected)


def test_loading_errors_are_one_line():
    tensors, _ = qc.make_awq(N, 64, 32)
    del tensors["layer.qzeros"]
    with pytest.raises(qf.QuantConfigError, match="lacks layer.qzeros"):
        load(qc.AWQ_CONFIG, tensors)
    tensors, _ = qc.make_gptq(N, 64, 32, act_order=True)
    with pytest.raises(qf.QuantConfigError, match="desc_act is false"):
        load(qc.GPTQ_CONFIG, tensors)
    tensors, _ = qc.make_gptq(N, 64, 32)
    with pytest.raises(qf.QuantConfigError, match="shapes do not fit"):
        load({**qc.GPTQ_CONFIG, "group_size": 16}, tensors)
    tensors, _ = qc.make_fp8(N, 64)
    tensors["layer.weight"] = tensors["layer.weight"].float()
    with pytest.raises(qf.QuantConfigError, match="float8_e4m3fn"):
        load(qc.FBGEMM_CONFIG, tensors)


# ----------------------------------------------------------------------------- int4 (AWQ, GPTQ) kernel


def _int4_case(layout: str, k: int, group_size: int, **kwargs):
    if layout == "awq":
        return qc.AWQ_CONFIG | {"group_size": group_size}, qc.make_awq(N, k, group_size, **kwargs)
    config = qc.GPTQ_CONFIG | {"group_size": group_size, "desc_act": kwargs.get("act_order", False)}
    return config, qc.make_gptq(N, k, group_size, **kwargs)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_int4_gemm_fp16(tq, layout, m, tiles):
    """Group 32: with 32-deep tiles the one-group-per-tile path (integer dot, scale after), with
    64-deep ones each weight scaled before the dot."""
    config, (tensors, expected) = _int4_case(layout, 96, 32, seed=m)
    weight = kernel_weight(config, tensors, torch.float16)
    x = x_for(m, 96, torch.float16, seed=m)
    out = tq.int4_gemm(x, weight, blocks=tiles)
    assert out.shape == (m, N) and out.dtype == torch.float16
    assert_near(out, x.double() @ expected.double().t(), torch.float16)


@pytest.mark.parametrize("layout", ["awq", "gptq"])
def test_int4_gemm_groups_smaller_than_a_tile_fp32_with_bias(tq, layout, tiles):
    """Group 16 < BLOCK_K 32: each weight scaled before the dot; plus a bias; K = 80 leaves a masked tail."""
    config, (tensors, expected) = _int4_case(layout, 80, 16, seed=3)
    tensors["layer.bias"] = torch.randn(N)
    weight = kernel_weight(config, tensors, torch.float32)
    x = x_for(33, 80, torch.float32)
    out = tq.int4_gemm(x, weight, blocks=tiles)
    assert_near(out, x.double() @ expected.double().t() + tensors["layer.bias"].double(), torch.float32)


@pytest.mark.parametrize("m", [1, 33])
def test_gptq_act_order_and_v2_and_per_channel(tq, m, tiles):
    for config, (tensors, expected) in (
            _int4_case("gptq", 96, 32, act_order=True, seed=m),
            (qc.GPTQ_CONFIG | {"checkpoint_format": "gptq_v2"}, qc.make_gptq(N, 96, 32, v1=False, seed=m)),
            (qc.GPTQ_CONFIG | {"group_size": -1}, qc.make_gptq(N, 96, 96, seed=m))):
        weight = kernel_weight(config, tensors, torch.float16)
        x = x_for(m, 96, torch.float16, seed=m)
        assert_near(tq.int4_gemm(x, weight, blocks=tiles), x.double() @ expected.double().t(), torch.float16)
    assert weight.group_size == 96 and weight.g_idx is None


def test_int4_gemm_bf16_and_default_tiles(tq, bf16_interpreter):
    config, (tensors, expected) = _int4_case("awq", 128, 64, seed=5)
    weight = kernel_weight(config, tensors, torch.bfloat16)
    x = x_for(17, 128, torch.bfloat16)
    out = tq.quant_linear(x.view(1, 17, 128), weight)  # the dispatch, default tiles (64-row, 64 deep)
    assert out.shape == (1, 17, N) and out.dtype == torch.bfloat16
    assert_near(out[0], x.double() @ expected.double().t(), torch.bfloat16)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("case", ["awq", "gptq-act-order", "mxfp4"])
def test_split_k_adds_partial_tiles_once_each(tq, case, split_k, tiles):
    """Split-K (decode batches on CUDA): programs share an output tile, each taking every
    split_k-th K tile, adding into fp32; the bias is added once. K = 160: 5 tiles of 32 (3 of 64), so the
    splits get unequal shares (3 of them one tile fewer, or 2 none at all...)."""
    k, m = 160, 3
    if case == "mxfp4":
        tensors, expected = qc.make_mxfp4(N, k, seed=split_k)
        config = qc.MXFP4_CONFIG
        tensors["layer_bias"] = torch.randn(N)
        bias = tensors["layer_bias"]
        weight = qf.Mxfp4Weight(tensors["layer_blocks"].flatten(-2), tensors["layer_scales"], bias.half())
        run = tq.mxfp4_gemm
    else:
        config, (tensors, expected) = _int4_case("awq" if case == "awq" else "gptq", k, 32, seed=split_k,
                                                 **({} if case == "awq" else {"act_order": True}))
        tensors["layer.bias"] = bias = torch.randn(N)
        weight = kernel_weight(config, tensors, torch.float16)
        run = tq.int4_gemm
    x = x_for(m, k, torch.float16, seed=split_k)
    out = run(x, weight, blocks=tiles, split_k=split_k)
    assert out.dtype == torch.float16 and out.shape == (m, N)
    reference = x.double() @ expected.double().t() + bias.half().double()
    assert_near(out, reference, torch.float16)
    assert_near(run(x, weight, blocks=tiles, split_k=1), reference, torch.float16)


def test_split_k_choice(monkeypatch):
    from workers.kernels.triton_quant import _choose_split_k  # plain Python: no kernel runs

    assert _choose_split_k(1, 1024, 4096, 64, 64, torch.device("cpu")) == 1
    # an H100's SM count, for a device that does not exist here; in the function's own module (the
    # interpreter's fixture may have left another copy of triton_quant on the package)
    monkeypatch.setitem(_choose_split_k.__globals__["_NUM_SMS"], 7, 132)
    cuda = torch.device("cuda", 7)
    assert _choose_split_k(1, 1024, 4096, 64, 64, cuda) == 16  # 16 N tiles * 16 = 256 programs
    assert _choose_split_k(1, 14336, 4096, 64, 64, cuda) == 2
    assert _choose_split_k(1, 4096, 4096, 64, 64, cuda) == 4  # 5 wanted, rounded down to a power of two
    assert _choose_split_k(1, 1024, 256, 64, 64, cuda) == 1  # 4 K tiles: no share below 4 tiles
    assert _choose_split_k(17, 1024, 4096, 64, 64, cuda) == 1  # past decode sizes: one program a tile


@pytest.mark.parametrize("tiles", [(16, 128, 128, 4, 3, True), (1, 256, 32, 8, 3, True), (64, 64, 128, 4, 3, True)],
                         ids=["decode-wide", "one-row-wide", "batch-wide"])
@pytest.mark.parametrize("case", ["awq", "gptq-act-order", "mxfp4"])
def test_the_chosen_tile_sizes(tq, case, tiles):
    """The tiles _choose_blocks gives real layers (16 AWQ words or GPTQ word rows, four MXFP4 scale
    groups a tile), on a weight of two K tiles and a partial N tile, with split-K as a decode has."""
    n, k, m = 200, 256, 1 if tiles[0] == 1 else 5
    if case == "mxfp4":
        tensors, expected = qc.make_mxfp4(n, k, seed=4)
        weight = kernel_weight(qc.MXFP4_CONFIG, tensors)
        run = tq.mxfp4_gemm
    else:
        if case == "awq":
            config, (tensors, expected) = qc.AWQ_CONFIG | {"group_size": 128}, qc.make_awq(n, k, 128, seed=4)
        else:
            config = qc.GPTQ_CONFIG | {"group_size": 128, "desc_act": True}
            tensors, expected = qc.make_gptq(n, k, 128, act_order=True, seed=4)
        weight = kernel_weight(config, tensors, torch.float16)
        run = tq.int4_gemm
    x = x_for(m, k, torch.float16, seed=4)
    reference = x.double() @ expected.double().t()
    for split_k in (1, 2):
        assert_near(run(x, weight, blocks=tiles, split_k=split_k), reference, torch.float16)


# ----------------------------------------------------------------------------- mxfp4 kernel


@pytest.mark.parametrize("m", MS)
def test_mxfp4_gemm_fp16(tq, m, tiles):
    tensors, expected = qc.make_mxfp4(N, 96, seed=m)
    weight = kernel_weight(qc.MXFP4_CONFIG, tensors)
    x = x_for(m, 96, torch.float16, seed=m)
    out = tq.mxfp4_gemm(x, weight, blocks=tiles)
    assert out.dtype == torch.float16
    assert_near(out, x.double() @ expected.double().t(), torch.float16)


def test_mxfp4_gemm_every_code_and_extreme_scales(tq, tiles):
    """All 16 e2m1 codes and scale bytes 1 (2 ** -126), 100, 126..128, 130 and 250, in fp32 (exact
    products): the decode is exact, bit for bit against the torch dequantize. (Byte 0, 2 ** -127,
    is a subnormal that a GPU may flush to zero; byte 255 is E8M0's NaN: neither is checked.)"""
    codes = torch.arange(16, dtype=torch.uint8)
    blocks = (codes.repeat(8)[0::2] | (codes.repeat(8)[1::2] << 4)).repeat(8, 1)  # [8, 64 bytes]: K = 128
    scales = torch.tensor([1, 100, 126, 127, 128, 250, 120, 130], dtype=torch.uint8)[:, None].repeat(1, 4)
    weight = qf.Mxfp4Weight(blocks.contiguous(), scales.contiguous(), None)
    eye = torch.eye(128)
    out = tq.mxfp4_gemm(eye, weight, blocks=tiles)  # row k of the result = column k of W
    assert torch.equal(out.t(), qf.dequantize(weight))


def test_mxfp4_bf16_with_bias(tq, bf16_interpreter):
    tensors, expected = qc.make_mxfp4(N, 64, seed=9)
    bias = torch.randn(N)
    weight = qf.Mxfp4Weight(tensors["layer_blocks"].flatten(-2), tensors["layer_scales"], bias.bfloat16())
    x = x_for(16, 64, torch.bfloat16)
    out = tq.quant_linear(x, weight)
    assert_near(out, x.double() @ expected.double().t() + bias.bfloat16().double(), torch.bfloat16)


@pytest.mark.parametrize(("num_tokens", "top_k", "dtype"), [(1, 2, torch.float32), (9, 2, torch.float16),
                                                         (20, 3, torch.float32)], ids=str)
def test_moe_mxfp4_gemm_against_float64_per_pair(tq, num_tokens, top_k, dtype):
    """The grouped MXFP4 GEMM over 4 stacked experts (the last never chosen, its scales 255 = NaN
    so a read of it shows), both launch forms of triton_moe: x gathered by token, and one row per
    pair times its routing weight, each with the expert's bias."""
    from workers.kernels.triton_moe import align_pairs

    num_experts, k = 4, 64
    tensors, expected = qc.make_mxfp4(N, k, experts=num_experts, seed=num_tokens)
    generator = torch.Generator().manual_seed(num_tokens)
    bias = torch.randn(num_experts, N, generator=generator)
    scales = tensors["layer_scales"].clone()
    scales[-1] = 255
    weight = qf.Mxfp4Weight(tensors["layer_blocks"].flatten(-2).contiguous(), scales, bias.to(dtype))
    expert_ids = torch.stack([torch.randperm(num_experts - 1, generator=generator)[:top_k] for _ in range(num_tokens)])
    routing = torch.rand(num_tokens, top_k, generator=generator)
    num_pairs = num_tokens * top_k
    aligned = align_pairs(expert_ids, num_experts, 16)
    flat = expert_ids.flatten()
    x = x_for(num_tokens, k, dtype, seed=num_tokens)
    by_token = tq.moe_mxfp4_gemm(x, weight, *aligned, num_pairs, top_k, block_m=16, block_n=16, block_k=32)
    reference = torch.stack([expected[flat[p]].double() @ x[p // top_k].double() + bias.to(dtype)[flat[p]].double()
                             for p in range(num_pairs)])
    assert by_token.dtype == dtype and torch.isfinite(by_token).all()
    assert_near(by_token, reference, dtype)
    rows = x_for(num_pairs, k, dtype, seed=99)
    per_pair = tq.moe_mxfp4_gemm(rows, weight, *aligned, num_pairs, 1, routing.flatten().contiguous(),
                                 block_m=16, block_n=16, block_k=32)
    reference = torch.stack([routing.flatten()[p].double() * (expected[flat[p]].double() @ rows[p].double()
                                                              + bias.to(dtype)[flat[p]].double())
                             for p in range(num_pairs)])
    assert_near(per_pair, reference, dtype)


# ----------------------------------------------------------------------------- fp8


def test_interpreter_fp8_cast_is_wrong_without_the_patch(tq):
    """Records the interpreter bug the fp8_cast_interpreter fixture works around (module docstring)."""
    x = torch.tensor([[448.0, 124.0650, 1.0, -31.8887]])  # scale 1: 124.07 rounds up to 128, -31.89 to -32
    q, scale = tq.quantize_fp8_per_token(x, scale_ub=None)
    reference, _ = tq.quantize_fp8_reference(x)
    assert float(scale[0]) == 1.0 and reference.float().tolist() == [[448.0, 128.0, 1.0, -32.0]]
    if torch.equal(q.view(torch.uint8), reference.view(torch.uint8)):
        pytest.skip("this triton's interpreter casts fp32 -> e4m3 correctly: the fixture is no longer needed")
    wrong = (q.float() - reference.float()).abs().max()
    assert wrong > 1, "wrong by a factor of two where a carry crosses a power of 2"


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("ub", [None, 0.5])
def test_quantize_fp8_per_token(tq, fp8_cast_interpreter, m, ub):
    x = x_for(m, 200, torch.float16, seed=m) * torch.logspace(-3, 1, m)[:, None].half()
    x[0] = 0  # an all-zero row keeps the minimum scale
    q, scale = tq.quantize_fp8_per_token(x, ub, block_k=64)
    expected_q, expected_scale = tq.quantize_fp8_reference(x, ub)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (m,)
    torch.testing.assert_close(scale, expected_scale, rtol=1e-6, atol=0)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))
    if ub is not None and m > 1:
        assert (q.float().abs() == 448).any(), "the cap never clipped: vacuous"


@pytest.mark.parametrize("m", MS)
def test_fp8_gemm_w8a8(tq, m):
    """fp8 activations and weights, decoded from bytes in the kernel (no cast patch needed)."""
    tensors, expected = qc.make_fp8(N, 96, seed=m)
    weight = kernel_weight(qc.FBGEMM_CONFIG, tensors)
    q, scale = tq.quantize_fp8_reference(x_for(m, 96, torch.bfloat16, seed=m))
    out = tq.fp8_gemm(q, scale, weight, torch.float32, blocks=TILES)
    reference = (q.double() * scale.double()[:, None]) @ expected.double().t()
    assert_near(out, reference, torch.float32, tol=1e-5)  # fp16 products of e4m3 values are exact


@pytest.mark.parametrize(("strategy", "dtype"), [("channel", torch.float16), ("tensor", torch.float16),
                                                  ("channel", torch.bfloat16), ("tensor", torch.float32)], ids=str)
def test_fp8_weight_only(tq, request, strategy, dtype):
    if dtype == torch.bfloat16:
        request.getfixturevalue("bf16_interpreter")
    tensors, expected = qc.make_fp8(N, 96, per_channel=strategy == "channel", seed=4)
    weight = kernel_weight(qc.compressed_tensors_config(strategy, None), tensors, dtype)
    x = x_for(33, 96, dtype)
    out = tq.quant_linear(x, weight)
    assert out.dtype == dtype
    assert_near(out, x.double() @ expected.double().t(), dtype)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_fp8_linear_against_dequantized_float(tq, fp8_cast_interpreter, activations):
    """The whole w8a8 path (quantize x, fp8 GEMM) against x @ W.T in float64: within e4m3's
    rounding of x (2 ** -4 relative per element)."""
    tensors, expected = qc.make_fp8(N, 128, seed=6, input_scale=0.02 if activations == "static" else None)
    tensors["layer.bias"] = torch.randn(N)
    weight = kernel_weight(qc.compressed_tensors_config("channel", activations), tensors, torch.float16)
    assert weight.activations == ("dynamic_token" if activations == "dynamic" else "static_tensor")
    x = x_for(16, 128, torch.float16, seed=6)
    out = tq.fp8_linear(x, weight, blocks=TILES)
    exact = x.double() @ expected.double().t() + tensors["layer.bias"].half().double()
    assert_near(out, exact, torch.float16, tol=0.05)
    q, scale = tq.quantize_fp8_reference(x, static_scale=weight.input_scale if activations == "static" else None)
    assert_near(out, (q.double() * scale.double()[:, None]) @ expected.double().t()
                + tensors["layer.bias"].half().double(), torch.float16)


@pytest.mark.parametrize("config", ["fbgemm", "static"])
def test_fp8_linear_through_scaled_mm_on_cpu(tq, fp8_cast_interpreter, config):
    """The torch._scaled_mm call itself (row-wise scales [M, 1] and [1, N], the weight transposed
    column-major, bias, bf16 out), run by torch's CPU implementation: the same result as the
    Triton FP8 GEMM within bf16 rounding."""
    static = config == "static"
    tensors, expected = qc.make_fp8(N * 2, 128, seed=8, input_scale=0.02 if static else None)
    tensors["layer.bias"] = torch.randn(N * 2)
    spec_config = qc.compressed_tensors_config("channel", "static") if static else qc.FBGEMM_CONFIG
    weight = kernel_weight(spec_config, tensors, torch.bfloat16)
    x = x_for(33, 128, torch.bfloat16, seed=8)
    assert not tq.uses_scaled_mm(x, weight), "CPU tensors never pick it on their own"
    via_scaled_mm = tq.fp8_linear(x, weight, use_scaled_mm=True)
    q, scale = tq.quantize_fp8_reference(x, weight.activation_scale_ub,
                                         static_scale=weight.input_scale if static else None)
    reference = (q.double() * scale.double()[:, None]) @ expected.double().t() + weight.bias.double()
    assert via_scaled_mm.dtype == torch.bfloat16
    assert_near(via_scaled_mm, reference, torch.bfloat16)


def test_launchers_reject_bad_inputs(tq):
    config, (tensors, _) = _int4_case("awq", 64, 32)
    weight = kernel_weight(config, tensors, torch.float16)
    with pytest.raises(AssertionError, match="x must be"):
        tq.int4_gemm(torch.zeros(2, 48, dtype=torch.float16), weight)
    with pytest.raises(AssertionError, match="dtype"):
        tq.int4_gemm(torch.zeros(2, 64, dtype=torch.int32), weight)
    mx = kernel_weight(qc.MXFP4_CONFIG, qc.make_mxfp4(N, 64, experts=2)[0])
    with pytest.raises(AssertionError, match="expert"):
        tq.mxfp4_gemm(torch.zeros(2, 64), mx)
    assert tq.int4_gemm(torch.zeros(0, 64, dtype=torch.float16), weight).shape == (0, N)


# ----------------------------------------------------------------------------- CUDA compilation


def test_quant_kernels_compile_for_cuda_targets():
    """The launchers' real arguments compile to cubins for sm_80 and sm_90 (the quantizer for
    sm_89 and sm_90), by tests/gpu/cuda_compile_quant.py in a child process without
    TRITON_INTERPRET. Nothing runs on a GPU: this proves they compile, not that they are right."""
    if not IN_PROCESS:
        pytest.skip(NOT_IN_PROCESS_REASON)
    repo = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    child = subprocess.run([sys.executable, str(repo / "tests" / "gpu" / "cuda_compile_quant.py")],
                           env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    if child.returncode == 2:
        pytest.skip(child.stdout.strip())
    assert child.returncode == 0, f"{child.stdout}\n{child.stderr[-3000:]}"
    assert child.stdout.count("ok   sm_") == 72, child.stdout
