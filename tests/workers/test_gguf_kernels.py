"""Our products with GGUF-quantized weights (csrc/gguf_gemm.c, workers/kernels/gguf.py) against
the reference (the gguf package's dequantization, then an fp32 matmul), for every type, row
count, dtype and mode, on this machine's build and on an AVX2-only and a portable build of the
same sources; and the C layer loop over GGUF weights against the Python loop.

Tolerances:
- fp32 mode: only fp32 summation differs from the reference: 1e-5 of the output's scale.
- int8 mode: x is rounded to int8 per 32-block with scale s = max|x_block| / 127, so each x
  value moves by at most s / 2 and each output by at most sum_k |w[n, k]| s_block(k) / 2: the
  test asserts that bound per output (plus the fp32 term).
- int16 mode (packed Q8_0 only): the same bound with s = max|x_block| / 32767.
- bf16 outputs are also rounded once to bf16 (half an ulp: 2^-9 of the value).
"""

from __future__ import annotations

import dataclasses
import platform

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from workers.gguf_weight import (BLOCK_LAYOUT, PACKABLE_TYPES, GGMLType, GgufWeight, concat_rows, dequantize,
                                 dequantize_rows, gguf_linear, gguf_logits, pack_columns, pack_for_kernels,
                                 reference_linear, unpack_columns)
from workers.kernels import gguf
from workers.kernels.cpu_isa import cpu_plan, using_plan, without_tiles
from workers.kernels.native import build, load, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")

TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
ROWS = [1, 2, 3, 4, 5, 17, 64]
N, K = 37, 512  # odd N: a last column range of 5
PACKED_N = 40  # a packed weight's rows come in groups of 8


def random_gguf_weight(ggml_type: GGMLType, out_features: int, in_features: int, seed: int = 0,
                       std: float = 1.0) -> GgufWeight:
    """Normal weights quantized by the gguf package (Q8_0, Q4_0, Q4_1), or, for the K-types it
    cannot quantize, random blocks whose fp16 scales are set to small positive values (every
    other byte, the packed 6-bit scales and minimums and the quants, random)."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(seed)
    if ggml_type in (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1):
        values = (rng.standard_normal((out_features, in_features)) * std).astype(np.float32)
        blocks = quants.quantize(values, GGMLQuantizationType(int(ggml_type)))
        return GgufWeight(ggml_type, out_features, in_features, torch.from_numpy(np.ascontiguousarray(blocks)))
    per_block, block_bytes = BLOCK_LAYOUT[ggml_type]
    blocks = rng.integers(0, 256, (out_features, in_features // per_block, block_bytes), dtype=np.uint8)
    scales = ((rng.random((out_features, in_features // per_block, 2)) + 0.1) * std / 64).astype(np.float16)
    offsets = [208] if ggml_type == GGMLType.Q6_K else [0, 2]  # Q6_K: d last; Q4_K, Q5_K: d, dmin first
    for i, offset in enumerate(offsets):
        blocks[:, :, offset:offset + 2] = scales[:, :, i:i + 1].view(np.uint8)
    return GgufWeight(ggml_type, out_features, in_features,
                      torch.from_numpy(np.ascontiguousarray(blocks.reshape(out_features, -1))))


def _build_for(march: str, tmp_path_factory):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds only")
    return load(build(tmp_path_factory.mktemp(f"kernels-{march}"), march=march))


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64"])
def library(request, tmp_path_factory):
    """This machine's build; an AVX2 + FMA build without AVX-512 (what an AVX-512 CI machine
    would not run otherwise); and a portable build (the C fallback)."""
    if request.param == "native":
        from workers.kernels.native import native_library

        return native_library()
    return _build_for(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def weights():
    return {t: random_gguf_weight(t, N, K, seed=int(t)) for t in TYPES}


QUANTIZED_X_LEVELS = {"int8": 127, "int16": 32767}  # a mode's largest |q| of x


def rounding_error_bound(x: torch.Tensor, full: torch.Tensor, mode: str = "int8") -> torch.Tensor:
    """[rows, N]: sum_k |w[n, k]| * s(row, block of k) / 2, the most x's rounding to the mode's
    integers can move an output."""
    x = x.float()
    scale = x.reshape(x.shape[0], -1, 32).abs().amax(dim=-1) / QUANTIZED_X_LEVELS[mode]  # [rows, K / 32]
    return (scale.repeat_interleave(32, dim=1) / 2) @ full.abs().T


def assert_close_to_reference(out, x, weight, full, bias, mode):
    expected = F.linear(x.float(), full, None if bias is None else bias.float())
    scale = expected.abs().max().item()
    allowed = torch.full_like(expected, 1e-5 * scale + 1e-6)
    if mode in QUANTIZED_X_LEVELS:
        allowed = allowed + rounding_error_bound(x, full, mode) * 1.001
    if out.dtype == torch.bfloat16:
        allowed = allowed + expected.abs() * 2.0 ** -8  # the result rounded to bf16, and bias's rounding to bf16
    error = (out.float() - expected).abs()
    assert (error <= allowed).all(), (f"{weight.ggml_type.name} {mode} rows {x.shape[0]} {x.dtype}: "
                                      f"worst error {(error - allowed).max().item():.3g} over its bound")


def checked_products(weight: GgufWeight, mode: str, library):
    """The kernel's product for every dtype, row count in ROWS and bias (none, or one), each
    asserted within its bound of the reference; yields (x, bias, out) for further checks."""
    full = dequantize(weight)
    generator = torch.Generator().manual_seed(int(weight.ggml_type))
    for dtype in (torch.float32, torch.bfloat16):
        bias = torch.randn(weight.out_features, generator=generator).to(dtype)
        for rows in ROWS:
            x = torch.randn(rows, weight.in_features, generator=generator).to(dtype)
            for b in (None, bias):
                out = gguf.gguf_gemm(x, weight, b, mode=mode, library=library)
                assert out.dtype == dtype and out.shape == (rows, weight.out_features)
                assert_close_to_reference(out, x, weight, full, b, mode)
                yield x, b, out


@pytest.mark.parametrize("mode", ["fp32", "int8"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_every_type_and_row_count_matches_the_reference(library, weights, ggml_type, mode):
    weight = weights[ggml_type]
    full = dequantize(weight)
    for x, bias, _ in checked_products(weight, mode, library):
        if bias is None:  # logits: fp32 out of any x
            logits = gguf.gguf_gemm(x, weight, None, out_dtype=torch.float32, mode=mode, library=library)
            assert logits.dtype == torch.float32
            assert_close_to_reference(logits, x, weight, full, None, mode)


@pytest.fixture(scope="module")
def packed_weights():
    return {t: pack_columns(random_gguf_weight(t, PACKED_N, K, seed=int(t) + 100)) for t in PACKABLE_TYPES}


@pytest.mark.parametrize("layout", ["file", "packed"])
@pytest.mark.parametrize("mode", ["fp32", "int8", "int16"])
def test_a_row_is_the_same_alone_in_a_batch_and_on_any_thread_count(weights, packed_weights, mode, layout):
    """Each output is one sum in block order whatever the row tile or thread: a sequence gets
    the same logits alone or in a batch."""
    if mode == "int16" and layout == "file":
        pytest.skip("the int16 mode is a packed Q8_0's only")
    chosen = [weights[GGMLType.Q4_K]] if layout == "file" else [packed_weights[t] for t in PACKABLE_TYPES]
    if mode == "int16":
        chosen = [packed_weights[GGMLType.Q8_0]]
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    for weight in chosen:
        try:
            torch.set_num_threads(2)
            batch = gguf.gguf_gemm(x, weight, mode=mode)
            torch.set_num_threads(1)
            alone = torch.cat([gguf.gguf_gemm(x[i:i + 1], weight, mode=mode) for i in range(17)])
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(batch, alone), weight.ggml_type.name


def test_packing_permutes_the_bytes_eight_rows_at_a_time_and_unpacking_restores_them(weights):
    for ggml_type in PACKABLE_TYPES:
        weight = random_gguf_weight(ggml_type, PACKED_N, K, seed=3)
        packed = pack_columns(weight)
        assert packed.packed and not weight.packed and packed.blocks.shape == weight.blocks.shape
        assert not torch.equal(packed.blocks, weight.blocks)
        assert torch.equal(packed.blocks.flatten().sort().values, weight.blocks.flatten().sort().values)
        # group 0, block 0: the 8 rows' fp16 scales, then (Q4_1) minimums, then the values: piece 0
        # of each row (Q4_0, Q4_1) or weight 0 of each row (Q8_0)
        head = 4 if ggml_type == GGMLType.Q4_1 else 2
        first = packed.blocks.flatten()[:8 * BLOCK_LAYOUT[ggml_type][1]]
        assert torch.equal(first[:16], weight.blocks[:8, :2].flatten())
        if ggml_type == GGMLType.Q8_0:
            assert torch.equal(first[16:32], weight.blocks[:8, 2:4].T.flatten())  # weights 0 and 1 of each row
        else:
            assert torch.equal(first[8 * head:8 * head + 32], weight.blocks[:8, head:head + 4].flatten())
        assert torch.equal(unpack_columns(packed).blocks, weight.blocks) and unpack_columns(weight) is weight
        assert torch.equal(dequantize(packed), dequantize(weight))
        index = torch.tensor([3, PACKED_N - 1, 0, 3])
        assert torch.equal(packed.rows(index).blocks, weight.rows(index).blocks)
        assert torch.equal(concat_rows([packed, weight]).blocks, concat_rows([weight, weight]).blocks)
        assert torch.equal(dequantize_rows(packed, index), dequantize(weight)[index])
    with pytest.raises(ValueError, match="Q4_0, Q4_1 and Q8_0"):
        pack_columns(random_gguf_weight(GGMLType.Q4_K, PACKED_N, K))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_columns(weights[GGMLType.Q4_1])  # 37 rows
    assert pack_for_kernels(weights[GGMLType.Q4_1]) is weights[GGMLType.Q4_1]  # kept as it is: 37 rows
    assert pack_for_kernels(random_gguf_weight(GGMLType.Q4_0, PACKED_N, K)).packed  # a layer's Q4_0
    q8 = random_gguf_weight(GGMLType.Q8_0, PACKED_N, K)
    assert pack_for_kernels(q8) is q8 and pack_for_kernels(q8, logits=True).packed  # Q8_0: an lm_head's only
    q4 = random_gguf_weight(GGMLType.Q4_1, PACKED_N, K)
    assert pack_for_kernels(q4, logits=True) is q4


@pytest.mark.parametrize("mode", ["fp32", "int8", "int16"])
@pytest.mark.parametrize("ggml_type", PACKABLE_TYPES, ids=lambda t: t.name)
def test_packed_weights_match_the_reference_and_every_build_agrees(library, packed_weights, ggml_type, mode):
    """The packed kernels (Q4_0 and Q4_1 int8, Q8_0 fp32 and int16) within their mode's bound of
    the reference, bit for bit the same on this machine's, the AVX2 and the portable build (one
    arithmetic: csrc/gguf_gemm.c); the other modes and the dequantization as through the file's
    layout. The int16 mode is a packed Q8_0's only: any other weight is refused."""
    from workers.kernels.native import native_library

    weight = packed_weights[ggml_type]
    full = dequantize(weight)
    assert torch.equal(gguf.gguf_dequantize(weight, library=library), full)
    index = torch.tensor([9, 0, PACKED_N - 1, 9])  # rows unpacked one by one: an embedding lookup
    assert torch.equal(gguf.gguf_dequantize(weight, index=index, library=library), full[index])
    if mode == "int16" and ggml_type != GGMLType.Q8_0:
        with pytest.raises(RuntimeError, match="rayllm_gguf_gemm"):
            gguf.gguf_gemm(torch.randn(2, K), weight, mode=mode, library=library)
        return
    if mode == "int16":  # and not the file's layout either
        with pytest.raises(RuntimeError, match="rayllm_gguf_gemm"):
            gguf.gguf_gemm(torch.randn(2, K), unpack_columns(weight), mode=mode, library=library)
    for x, bias, out in checked_products(weight, mode, library):
        if mode == "int16" or (mode == "int8") == (ggml_type != GGMLType.Q8_0):  # a packed kernel
            assert torch.equal(out, gguf.gguf_gemm(x, weight, bias, mode=mode, library=native_library()))
        else:
            assert torch.equal(out, gguf.gguf_gemm(x, unpack_columns(weight), bias, mode=mode, library=library))


@pytest.mark.parametrize("mode", ["fp32", "int8", "int16"])
@pytest.mark.parametrize("ggml_type", PACKABLE_TYPES, ids=lambda t: t.name)
def test_a_packed_product_of_many_rows_goes_chunk_by_chunk_and_loses_no_row(library, packed_weights, ggml_type,
                                                                            mode):
    """A prompt step's rows go through a packed weight in chunks of about 128 KB of x
    (csrc/gguf_gemm.c, PACKED_CHUNK_BYTES: 256 int8 rows of this K, 128 int16 ones, 64 fp32
    ones), each chunk through every column group before the next (a packed Q4's int8 rows on
    AVX2 go 16 rows through 16 groups at a time instead: the test below): 300 rows, a partial
    last tile in each mode, are each within the reference's bound, with and without bias, and
    the same as the rows taken a few at a time."""
    if mode == "int16" and ggml_type != GGMLType.Q8_0:
        pytest.skip("the int16 mode is a packed Q8_0's only")
    weight = packed_weights[ggml_type]
    full = dequantize(weight)
    generator = torch.Generator().manual_seed(300)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(300, K, generator=generator).to(dtype)
        bias = torch.randn(PACKED_N, generator=generator).to(dtype)
        for b in (None, bias):
            out = gguf.gguf_gemm(x, weight, b, mode=mode, library=library)
            assert_close_to_reference(out, x, weight, full, b, mode)
            pieces = torch.cat([gguf.gguf_gemm(x[i:i + 23], weight, b, mode=mode, library=library)
                                for i in range(0, 300, 23)])
            assert torch.equal(out, pieces)



@pytest.mark.parametrize(("ggml_type", "mode"), [(GGMLType.Q4_0, "int8"), (GGMLType.Q4_1, "int8"),
                                                (GGMLType.Q8_0, "int16")], ids=lambda v: getattr(v, "name", v))
def test_a_prompt_steps_rows_through_many_packed_groups_are_those_of_a_few_rows(library, ggml_type, mode):
    """Past 4 rows a packed Q4 int8 product (or a Q8_0 lm_head's int16 one) on AVX2 takes 16 rows
    through up to 16 column groups at once, x's block widened once for them all (csrc/gguf_gemm.c,
    packed_int8_groups, packed_q8_int16_groups; AVX-512 VNNI builds take two groups, 16 columns,
    per 512-bit vector instead, and an odd item's last group as AVX2 does: packed_int8_pair,
    packed_q8_int16_pair): on one thread and two, with a last tile of 2 rows, its outputs are
    within the reference's bound and bit for bit those of the same rows 4 at a time (a tile's sums
    in registers, or on a CPU with AMX the int16 pair from 2 rows) and those of every build (the
    portable one has none of these kernels)."""
    from workers.kernels.native import native_library

    weight = pack_columns(random_gguf_weight(ggml_type, 8 * 72, 64, seed=int(ggml_type) + 200))  # 72 groups
    full = dequantize(weight)
    generator = torch.Generator().manual_seed(290)
    x = torch.randn(290, 64, generator=generator)
    bias = torch.randn(weight.out_features, generator=generator)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):  # an item of 18 groups (16, then 2), or of 9
            torch.set_num_threads(num_threads)
            for b in (None, bias):
                out = gguf.gguf_gemm(x, weight, b, mode=mode, library=library)
                assert_close_to_reference(out, x, weight, full, b, mode)
                pieces = torch.cat([gguf.gguf_gemm(x[i:i + 4], weight, b, mode=mode, library=library)
                                    for i in range(0, 290, 4)])
                assert torch.equal(out, pieces)
                assert torch.equal(out, gguf.gguf_gemm(x, weight, b, mode=mode, library=native_library()))
                # this machine's few-row tiles too (a CPU with AMX takes its int16 ones to the pair)
                assert torch.equal(out, torch.cat([gguf.gguf_gemm(x[i:i + 4], weight, b, mode=mode,
                                                                  library=native_library())
                                                   for i in range(0, 290, 4)]))
    finally:
        torch.set_num_threads(threads)


def test_int8_mode_differs_from_fp32_mode_within_its_bound(weights, packed_weights):
    """The int8 and int16 modes really quantize x (the bounds above are what they are held to, not
    a pass-through), and int16's error is far below int8's."""
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2))
    weight = weights[GGMLType.Q8_0]
    fp32, int8 = gguf.gguf_gemm(x, weight, mode="fp32"), gguf.gguf_gemm(x, weight, mode="int8")
    assert not torch.equal(fp32, int8)
    assert ((fp32 - int8).abs() <= rounding_error_bound(x, dequantize(weight)) * 1.001 + 1e-4).all()
    packed = packed_weights[GGMLType.Q8_0]
    fp32, int16 = gguf.gguf_gemm(x, packed, mode="fp32"), gguf.gguf_gemm(x, packed, mode="int16")
    assert not torch.equal(fp32, int16)
    assert ((fp32 - int16).abs() <= rounding_error_bound(x, dequantize(packed), "int16") * 1.001 + 1e-5).all()
    int8 = gguf.gguf_gemm(x, unpack_columns(packed), mode="int8")
    assert (fp32 - int16).abs().max() < (fp32 - int8).abs().max() / 50


def test_gguf_linear_runs_the_kernel_and_falls_back_to_the_reference(weights):
    weight = weights[GGMLType.Q4_1]
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(4))
    assert torch.equal(gguf_linear(x, weight, bias), gguf.gguf_gemm(x, weight, bias))
    assert gguf_linear(x, weight, out_dtype=torch.float32).dtype == torch.float32
    x64 = x.double()  # a dtype the kernel does not take: the reference
    assert not gguf.native_takes(x64, weight)
    torch.testing.assert_close(gguf_linear(x64, weight, bias), reference_linear(x64, weight, bias))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_dequantize_gives_the_gguf_packages_values(library, weights, ggml_type):
    weight = weights[ggml_type]
    expected = dequantize(weight)
    for scratch in (False, True):
        out = gguf.gguf_dequantize(weight, scratch=scratch, library=library)
        assert out.dtype == torch.float32 and out.shape == (N, K)
        assert torch.equal(out, expected)  # exact: gguf_weight.dequantize_rows says why
    index = torch.tensor([5, 0, 5, N - 1])
    assert torch.equal(dequantize_rows(weight, index), expected[index])  # an embedding lookup
    assert torch.equal(gguf.gguf_dequantize(weight, index=index, library=library), expected[index])
    assert gguf.gguf_dequantize(weight, index=index[:0], library=library).shape == (0, K)
    with pytest.raises(RuntimeError, match="rayllm_gguf_dequantize"):
        gguf.gguf_dequantize(weight, index=torch.tensor([N]), library=library)


def test_a_prompt_step_multiplies_by_the_dequantized_weight_and_a_decode_step_by_the_kernel(weights):
    """Without AMX tiles (cpu_isa: where the CPU has them, test_amx.py checks their dispatch), from
    gguf.DENSE_MIN_ROWS rows gguf_linear is the dense fp32 product of the dequantized weight
    (fp32-exact, no int8 rounding); below, the int8 kernel."""
    with using_plan(without_tiles(cpu_plan())):
        check_the_vector_paths_dispatch(weights)


def check_the_vector_paths_dispatch(weights):
    weight = weights[GGMLType.Q4_K]
    generator = torch.Generator().manual_seed(6)
    bias = torch.randn(N, generator=generator)
    rows = gguf.DENSE_MIN_ROWS
    x = torch.randn(rows, K, generator=generator)
    expected = F.linear(x, dequantize(weight), bias)
    out = gguf_linear(x, weight, bias)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert not torch.equal(out, gguf.gguf_gemm(x, weight, bias, mode="int8"))
    assert gguf_linear(x.bfloat16(), weight, bias.bfloat16()).dtype == torch.bfloat16
    fewer = x[:rows - 1]
    assert torch.equal(gguf_linear(fewer, weight, bias), gguf.gguf_gemm(fewer, weight, bias))


def test_a_packed_weights_prompt_step_stays_on_its_int8_kernel(packed_weights):
    """The packed int8 kernel is faster than dequantizing at any number of rows (bench.bench_gguf);
    a packed Q8_0 lm_head's fp32 product is not, and its prompt logits go dense (gguf.goes_dense).
    (Without AMX tiles: with them, such a prompt step runs on the tiles, test_amx.py.)"""
    weight = packed_weights[GGMLType.Q4_1]
    x = torch.randn(gguf.DENSE_MIN_ROWS, K, generator=torch.Generator().manual_seed(7))
    with using_plan(without_tiles(cpu_plan())):
        assert torch.equal(gguf_linear(x, weight), gguf.gguf_gemm(x, weight, mode="int8"))
    assert gguf.goes_dense(weight, gguf.DENSE_MIN_ROWS, "fp32") and not gguf.goes_dense(weight, gguf.DENSE_MIN_ROWS)
    head = packed_weights[GGMLType.Q8_0]
    assert gguf.goes_dense(head, gguf.DENSE_MIN_ROWS, "fp32") and not gguf.goes_dense(head, gguf.DENSE_MIN_ROWS - 1)
    assert torch.equal(gguf_logits(x, head), F.linear(x, gguf.gguf_dequantize(head)))


def test_logits_keep_the_hidden_state_in_fp32_on_every_linear_backend(weights):
    """A GGUF lm_head in the file's layout (LOGITS_MODE) is the fp32-mode product, not int8's:
    rounding the last hidden state to 8 bits flips near-tied argmaxes (workers/kernels/gguf.py)."""
    from workers.linear import NativeLinear, OneDnnLinear, TorchLinear

    weight = weights[GGMLType.Q8_0]
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(5))
    fp32 = gguf.gguf_gemm(x, weight, out_dtype=torch.float32, mode="fp32")
    assert not torch.equal(fp32, gguf.gguf_gemm(x, weight, out_dtype=torch.float32, mode="int8"))
    for backend in (TorchLinear(), OneDnnLinear(), NativeLinear()):
        logits = backend.logits(x, backend.pack(weight))
        assert logits.dtype == torch.float32 and torch.equal(logits, fp32), backend.name
    bf16 = x.bfloat16()  # bf16 activations: widened, never rounded to int8
    torch.testing.assert_close(NativeLinear().logits(bf16, weight),
                               gguf.gguf_gemm(bf16, weight, out_dtype=torch.float32, mode="fp32"))


def test_a_packed_q8_0_lm_head_rounds_the_hidden_state_to_int16_on_every_linear_backend(packed_weights):
    """The default model's lm_head (a packed Q8_0) runs the int16 mode (gguf.logits_mode): its
    logits are that product on every backend, not the fp32 mode's and not int8's; an lm_head in
    the file's layout keeps the fp32 mode."""
    from workers.linear import NativeLinear, OneDnnLinear, TorchLinear

    head = packed_weights[GGMLType.Q8_0]
    assert gguf.logits_mode(head) == "int16" and gguf.logits_mode(unpack_columns(head)) == "fp32"
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(6))
    int16 = gguf.gguf_gemm(x, head, out_dtype=torch.float32, mode="int16")
    assert not torch.equal(int16, gguf.gguf_gemm(x, head, out_dtype=torch.float32, mode="fp32"))
    for backend in (TorchLinear(), OneDnnLinear(), NativeLinear()):
        logits = backend.logits(x, head)
        assert logits.dtype == torch.float32 and torch.equal(logits, int16), backend.name


def test_k_types_need_whole_super_blocks_and_the_kernel_checks_sizes(weights):
    for ggml_type in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K):
        with pytest.raises(ValueError, match="256-weight blocks"):
            GgufWeight(ggml_type, 4, 288, torch.zeros(4, 288 // 256 * BLOCK_LAYOUT[ggml_type][1], dtype=torch.uint8))
    weight = weights[GGMLType.Q4_K]
    x, out = torch.zeros(1, 288), torch.empty(1, N)
    from workers.kernels.native import native_library

    status = native_library().rayllm_gguf_gemm(x.data_ptr(), weight.blocks.data_ptr(), None, out.data_ptr(), 1, N, 288,
                                               int(GGMLType.Q4_K), 0, 0, 1, 1)
    assert status == 2
    status = native_library().rayllm_gguf_gemm(x.data_ptr(), weight.blocks.data_ptr(), None, out.data_ptr(), 1, N, 256,
                                               int(GGMLType.F16), 0, 0, 1, 1)
    assert status == 1
    with pytest.raises(ValueError, match="features"):
        gguf.gguf_gemm(torch.zeros(1, 256), weight)


# ---------------------------------------------------------------- the C layer loop over GGUF weights

LAYER_TYPES = [  # (qkv, o, gate_up, down) per layer: every type, and four types in one layer
    (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K),
    (GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.Q4_1),
    (GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.Q5_K),
]


def quantize_layers(model, layer_types=LAYER_TYPES) -> None:
    """Every layer's qkv, o, gate_up and down replaced by GGUF weights of layer_types (Q4_0 and
    Q4_1 packed, as the model loader packs them), and the C loop rebuilt for them."""
    from workers.native_forward import NativeForward

    c = model.config
    shapes = {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
              "o": (c.hidden_size, c.num_heads * c.head_dim),
              "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}
    for index, types in enumerate(layer_types):
        replaced = {name: pack_for_kernels(random_gguf_weight(t, *shapes[name], seed=10 * index + i, std=0.08))
                    for i, (name, t) in enumerate(zip(shapes, types))}
        model.layers[index] = dataclasses.replace(model.layers[index], **replaced)
    model.quantization = "gguf:" + ",".join(sorted({t.name for types in layer_types for t in types}))
    model.native_forward = NativeForward.for_model(model)


@pytest.mark.parametrize("dtype,threads", [("float32", 1), ("float32", 2), ("bfloat16", 2)])
def test_c_loop_over_gguf_weights_equals_the_python_loop(gguf_model_dir, dtype, threads):
    from runner_helpers import greedy, make_runner, prompts_of_lengths, run_requests
    from test_native_forward import compare_every_step

    runner = make_runner(gguf_model_dir, attention_backend="cpu", dtype=dtype, num_threads=threads)
    quantize_layers(runner.model)
    native = runner.model.native_forward
    # every product is a GGUF one: every step but a prompt step's many rows (those go dense, in Python),
    # unless such steps run on AMX tiles
    on_tiles = gguf.tiles_take(runner.model.layers[0].qkv, gguf.DENSE_MIN_ROWS)
    assert native is not None and native.max_rows == (None if on_tiles else gguf.DENSE_MIN_ROWS - 1)
    compared = compare_every_step(runner)
    prompts = prompts_of_lengths([1, 3, 8, 17, 29], runner.model_info.vocab_size)
    outputs = run_requests(runner, prompts, greedy(8), token_budget=16)
    assert len(compared) >= 10 and min(compared) < max(compared), compared
    assert all(len(tokens) == 8 for tokens in outputs)
    hidden = runner.model.layers[0]
    assert all(isinstance(getattr(hidden, name), GgufWeight) for name in ("qkv", "o", "gate_up", "down"))
    assert hidden.o.packed and hidden.gate_up.packed and not hidden.qkv.packed  # LAYER_TYPES[0]: Q4_0, Q4_1


def test_c_loop_over_packed_weights_takes_prompt_steps_too(gguf_model_dir):
    """Every product packed: no row limit, the C loop runs prompt steps of any length."""
    from runner_helpers import greedy, make_runner, prompts_of_lengths, run_requests
    from test_native_forward import compare_every_step

    runner = make_runner(gguf_model_dir, attention_backend="cpu", dtype="float32", num_threads=2)
    quantize_layers(runner.model, [(GGMLType.Q4_1, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_0)] * 3)
    native = runner.model.native_forward
    assert native is not None and native.max_rows is None
    compared = compare_every_step(runner)
    prompts = prompts_of_lengths([3, 40, 300], runner.model_info.vocab_size)
    outputs = run_requests(runner, prompts, greedy(4), token_budget=512)
    assert max(compared) >= 300 and all(len(tokens) == 4 for tokens in outputs)
