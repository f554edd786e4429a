"""Products on AMX tiles (csrc/amx.c) against float64 of the same bf16 operands, and the dispatch
that sends products to them (workers/kernels/cpu_isa.py).

The tiles multiply bf16 by bf16 into fp32 sums in an order of their own (not the panels'), so
each output is checked against float64 within the fp32 summation bound K 2^-24 sum_k |x_k w_k|
(plus half a bf16 ulp where the output is bf16). What is bit for bit: a row's result on tiles
does not depend on the rows beside it, and the C layer loop equals the Python loop.

On a CPU without AMX (or where the OS refuses tile data) the tile tests skip, saying why; the
dispatch tests run everywhere (test_builds.py compiles the AMX bodies on every machine).
"""

from __future__ import annotations

import dataclasses
import platform

import pytest
import torch
from runner_helpers import greedy, make_runner, prompts_of_lengths, run_requests
from test_gguf_kernels import quantize_layers, random_gguf_weight
from test_native_forward import compare_every_step

from workers.gguf_weight import (
    PACKABLE_TYPES,
    GGMLType,
    dequantize,
    gguf_linear,
    gguf_logits,
    pack_columns,
    unpack_columns,
)
from workers.kernels import cpu_isa, gguf
from workers.kernels.cpu_isa import CpuPlan, using_plan, without_tiles
from workers.kernels.native import LINEAR_PANELS, native_available, native_library
from workers.linear import NativeLinear
from workers.model import AttentionMetadata

pytestmark = pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")


def _tiles_reason() -> str | None:
    if not native_available():
        return "the C kernels do not build here"
    plan = cpu_isa.detected_plan()
    return None if plan.amx else f"AMX tiles: {plan.amx_status}"


needs_tiles = pytest.mark.skipif(_tiles_reason() is not None, reason=_tiles_reason() or "")


def bf16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 of x and weight rounded to bf16 (what the tiles multiply), and the fp32 summation
    bound of each output."""
    xb, wb = x.to(torch.bfloat16).double(), weight.to(torch.bfloat16).double()
    expected = xb @ wb.T + (0 if bias is None else bias.double())
    bound = x.shape[1] * 2.0 ** -24 * (xb.abs() @ wb.abs().T) + 1e-30
    return expected, bound


def assert_within(out: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> None:
    allowed = bound + (expected.abs() * 2.0 ** -8 if out.dtype == torch.bfloat16 else 0)
    error = (out.double() - expected).abs()
    assert (error <= allowed).all(), f"worst error {(error - allowed).max().item():.3g} over its bound"


SHAPES = [(1, 16, 32), (5, 40, 64), (17, 33, 96), (33, 576, 576), (300, 96, 1536), (64, 1001, 128)]


@needs_tiles
@pytest.mark.parametrize("rows, out_features, in_features", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_tiles_match_float64_of_the_same_operands(rows, out_features, in_features, threads):
    """Rows in blocks of 32 and a last block of 1-31 (read from a zero-padded copy), columns in
    groups of 32 and a last of 1-31 (one panel, or two cut short), bias or none, bf16 or fp32 out."""
    native = NativeLinear()
    generator = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16)
    packed = native.pack(weight)
    assert packed.native_operand().linear == LINEAR_PANELS  # packed as panels, which the tiles read
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b in (None, bias):
            for out_dtype in (torch.bfloat16, torch.float32):
                out = packed.tile_gemm(x, b, out_dtype)
                assert out.dtype == out_dtype and out.shape == (rows, out_features)
                assert_within(out, *bf16_reference(x, weight, b))
    finally:
        torch.set_num_threads(previous)


@needs_tiles
def test_a_row_on_tiles_is_the_same_in_every_batch():
    native = NativeLinear()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(300, 192, generator=generator).to(torch.bfloat16)
    weight = native.pack(torch.randn(330, 192, generator=generator).to(torch.bfloat16))
    alone = torch.cat([weight.tile_gemm(x[row:row + 1], None, torch.float32) for row in range(300)])
    for rows in (2, 15, 16, 17, 31, 32, 33, 64, 257, 300):
        assert torch.equal(weight.tile_gemm(x[:rows], None, torch.float32), alone[:rows]), rows


@needs_tiles
def test_the_dispatch_sends_many_rows_to_the_tiles_and_few_to_the_panels():
    """NativeLinear takes the tiles from the table's rows on (their answers differ from the
    panels' in the last bits, so which one ran shows), and the panels below and with tiles off."""
    native = NativeLinear()
    generator = torch.Generator().manual_seed(5)
    weight = native.pack(torch.randn(100, 576, generator=generator).to(torch.bfloat16))
    plan = cpu_isa.detected_plan()
    first = plan.tile_min_rows["bf16"]
    for rows in (first - 1, first, 4 * first):
        x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
        tiles = weight.tile_gemm(x, None, torch.float32)
        panels = weight.panel_gemm(x, None, torch.float32)
        assert not torch.equal(tiles, panels)  # fp32 sums bits apart somewhere in 100 x rows outputs
        assert torch.equal(native.logits(x, weight), tiles if rows >= first else panels)
        with using_plan(without_tiles(plan)):
            assert torch.equal(native.logits(x, weight), panels)


GGUF_TYPES = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]


@needs_tiles
@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 16, 45])
def test_gguf_tiles_match_float64_of_the_weights_in_bf16(ggml_type, rows):
    """Each group of 32 columns dequantized to bf16 (the fp32 mode's values, rounded once) and x
    rounded to bf16; packed Q4_0 and Q4_1 through their own decode, the rest through sub_weights;
    N = 72: a last group of 8 columns."""
    weight = random_gguf_weight(ggml_type, 72, 512, seed=int(ggml_type))
    full = dequantize(weight)
    generator = torch.Generator().manual_seed(rows)
    bias = torch.randn(72, generator=generator)
    variants = [weight] + ([pack_columns(weight)] if ggml_type in PACKABLE_TYPES else [])
    for w in variants:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 512, generator=generator).to(dtype)
            out = gguf.amx_gemm(x, w, bias)
            assert out.dtype == dtype and out.shape == (rows, 72)
            assert_within(out, *bf16_reference(x, full, bias.to(dtype)))


@needs_tiles
def test_gguf_layer_products_take_the_tiles_from_the_tables_rows_and_logits_never():
    weight = pack_columns(random_gguf_weight(GGMLType.Q4_1, 64, 256, seed=1))
    generator = torch.Generator().manual_seed(1)
    first = cpu_isa.detected_plan().tile_min_rows["gguf"]
    for rows in (first - 1, first):
        x = torch.randn(rows, 256, generator=generator)
        tiles, int8 = gguf.amx_gemm(x, weight), gguf.gguf_gemm(x, weight, mode="int8")
        assert torch.equal(gguf_linear(x, weight), tiles if rows >= first else int8)
        assert torch.equal(gguf_linear(x, weight, out_dtype=torch.float32, mode="fp32"),
                           gguf.gguf_gemm(x, weight, out_dtype=torch.float32, mode="fp32"))


@needs_tiles
@pytest.mark.parametrize("dtype, quantized", [("bfloat16", False), ("float32", True)], ids=["bf16", "gguf"])
def test_the_c_loop_on_tiles_equals_the_python_loop(tiny_model_dir, gguf_model_dir, dtype, quantized):
    """Prompt steps of 16 or more rows run their products on tiles in both loops: the same hidden
    states bit for bit, and steps on both sides of the table's rows."""
    runner = make_runner(gguf_model_dir if quantized else tiny_model_dir, attention_backend="cpu", dtype=dtype,
                         num_threads=2)
    if quantized:
        quantize_layers(runner.model)  # every GGUF type, packed and not
    assert runner.model.native_forward is not None
    compared = compare_every_step(runner)
    prompts = prompts_of_lengths([1, 3, 20, 29, 45], runner.model_info.vocab_size)
    run_requests(runner, prompts, greedy(6), token_budget=64)
    path = "gguf" if quantized else "bf16"
    first = cpu_isa.detected_plan().tile_min_rows[path]
    assert min(compared) < first <= max(compared), compared


@needs_tiles
def test_a_gguf_models_prompt_step_takes_the_bf16_tiles_at_any_rows(gguf_model_dir):
    """Five prompt rows run the GGUF products on the bf16 tiles (x rounded to bf16, cpu_isa's
    gguf_prompt), the same five rows of a step that computes no prompt on the int8 kernel."""
    runner = make_runner(gguf_model_dir, attention_backend="cpu", num_threads=2)
    quantize_layers(runner.model, [(GGMLType.Q4_1,) * 4] * runner.model.config.num_layers)
    model, plan = runner.model, cpu_isa.detected_plan()
    assert model.quantization.startswith("gguf") and 5 < plan.tile_min_rows["gguf_int8"]
    ids = torch.randint(0, runner.model_info.vocab_size, (5,), generator=torch.Generator().manual_seed(3))
    hidden = {}
    for computes_prompt in (True, False):
        positions, metadata = AttentionMetadata.one_sequence(5, runner.block_size, computes_prompt)
        hidden[computes_prompt] = model.forward(ids, positions, metadata, runner.kv_caches)
    with using_plan(dataclasses.replace(plan, tile_min_rows={**plan.tile_min_rows, "gguf": 1})):
        tiles = model.forward(ids, *AttentionMetadata.one_sequence(5, runner.block_size), runner.kv_caches)
    assert torch.equal(hidden[True], tiles) and not torch.equal(hidden[False], tiles)


def test_a_prompt_steps_plan_takes_the_gguf_tiles_from_gguf_prompts_rows():
    plan = CpuPlan(frozenset({"amx_bf16", "amx_int8"}), 16, True, "granted")
    prompt = plan.for_prompt_step()
    assert prompt.tiles_take("gguf", plan.tile_min_rows["gguf_prompt"]) and not plan.tiles_take("gguf", 1)
    assert {path: rows for path, rows in prompt.tile_min_rows.items() if path != "gguf"} == \
        {path: rows for path, rows in plan.tile_min_rows.items() if path != "gguf"}
    assert not without_tiles(plan).for_prompt_step().tiles_take("gguf", 10**6)


# ---------------------------------------------------------------- the dispatch and the builds


def test_the_plan_names_what_runs_each_path():
    plan = cpu_isa.cpu_plan()
    bf16 = plan.isa(torch.bfloat16, gguf=True)
    assert set(bf16) == {"products", "attention", "gguf"}
    assert ("amx-bf16" in bf16["products"]) == plan.amx == ("amx-bf16" in bf16["gguf"])
    assert "amx" not in plan.isa(torch.float32, gguf=False)["products"]  # no fp32 tiles
    off = without_tiles(plan)
    assert not off.amx and not off.tiles_take("bf16", 10**6) and off.min_rows("gguf") == 0
    assert "amx" not in off.isa(torch.bfloat16, gguf=True)["products"]


def test_amx_off_in_the_environment_keeps_the_tiles_off(monkeypatch):
    monkeypatch.setenv("RAYLLM_AMX", "off")
    plan = cpu_isa.plan_from(native_library())
    assert not plan.amx and plan.amx_status.startswith("off")


def test_a_granted_plan_takes_tiles_from_its_rows_only():
    plan = CpuPlan(frozenset({"amx_bf16"}), 16, True, "granted")
    first = plan.tile_min_rows["bf16"]
    assert plan.tiles_take("bf16", first) and not plan.tiles_take("bf16", first - 1)
    assert plan.min_rows("bf16") == first
    with using_plan(dataclasses.replace(plan, tile_min_rows={"bf16": 3, "gguf": 5})):
        assert cpu_isa.cpu_plan().tiles_take("bf16", 3) and not cpu_isa.cpu_plan().tiles_take("gguf", 4)
    assert cpu_isa.cpu_plan() is not plan or cpu_isa.detected_plan() is plan


def test_the_features_are_the_cpus():
    flags = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    features = cpu_isa.detected_plan().features
    for name, flag in (("avx2", " avx2"), ("avx512", " avx512f"), ("avx512_bf16", " avx512_bf16"),
                       ("amx_bf16", " amx_bf16")):
        if flags:
            assert (name in features) == (flag + " " in flags or flag + "\n" in flags), name


# ---------------------------------------------------------------- attention of prompts on tiles

# prompts and chunks of 16+ queries (after cached keys: one starting mid-block, one on a block
# boundary; one of 70 queries over two tasks' worth of blocks), beside decodes and short chunks
TILE_SPECS = [(0, 16), (37, 20), (70, 1), (0, 5), (48, 17), (5, 70), (0, 300)]


def _attend_bf16(batch, **variants):
    from workers.kernels import cpu_attention

    k_cache, v_cache = cpu_attention.from_standard_layout(batch.k_cache, batch.v_cache)
    cpu_attention.write_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping)
    return cpu_attention.paged_attention(batch.q, k_cache, v_cache, batch.block_tables, batch.query_start_loc,
                                         batch.seq_lens, batch.scale, **variants)


def _attend_half_pool(batch, **variants):
    from workers.kernels import cpu_attention

    k_cache, v_cache = cpu_attention.from_standard_layout(batch.k_cache.half(), batch.v_cache.half())
    cpu_attention.write_kv_cache(batch.k_new, batch.v_new, k_cache, v_cache, batch.slot_mapping)
    return cpu_attention.paged_attention(batch.q, k_cache, v_cache, batch.block_tables, batch.query_start_loc,
                                         batch.seq_lens, batch.scale, **variants)


@needs_tiles
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", [None, "window7", "all", "chunk7"])
def test_prompts_over_a_half_pool_on_tiles_match_the_oracle_to_bf16(head_dim, variant):
    """fp32 queries over an fp16 pool (a GGUF model's): prompts on tiles, their queries, keys and
    values rounded to bf16 as they are laid out for the tiles, within bf16's bound of the dense
    oracle; decodes and short chunks on the vector body, which keeps fp32 (its bits unchanged)."""
    import kernel_cases as kc

    batch = kc.make_batch(TILE_SPECS, block_size=16, num_kv_heads=2, num_queries_per_kv=3, head_dim=head_dim,
                          dtype=torch.float32, seed=head_dim)
    variants = kc.variant_kwargs(variant, 6) if variant else {}
    if kc.hides_keys(variants):
        kc.poison_outside_windows(batch, variants.get("window"), variants.get("attention_chunk"))
    tiles = _attend_half_pool(batch, **variants)
    with using_plan(without_tiles(cpu_isa.detected_plan())):
        vectors = _attend_half_pool(batch, **variants)
    assert tiles.dtype == torch.float32 and not tiles.isnan().any()
    assert kc.max_abs_err(tiles, kc.naive_attention(batch, **variants)) <= kc.ATOL[torch.bfloat16]
    starts = batch.query_start_loc.tolist()
    for s, (_, query_len) in enumerate(TILE_SPECS):
        rows = slice(starts[s], starts[s + 1])
        assert torch.equal(tiles[rows], vectors[rows]) == (query_len < cpu_isa.detected_plan().tile_min_rows["attention"])


@needs_tiles
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("variant", [None, "window16", "window7", "all", "chunk7", "chunk32"])
def test_prompts_attention_on_tiles_matches_the_oracle(head_dim, block_size, variant):
    """Sequences of 16+ queries on tiles, the rest on the vector body, in one call: every output
    within the bf16 bound of the dense oracle, pool slots outside the sequences (and blocks
    before windows and chunks) NaN; the tile rows differ from the vector body's in rounding only."""
    import kernel_cases as kc

    batch = kc.make_batch(TILE_SPECS, block_size=block_size, num_kv_heads=2, num_queries_per_kv=3,
                          head_dim=head_dim, dtype=torch.bfloat16, seed=block_size)
    variants = kc.variant_kwargs(variant, 6) if variant else {}
    if kc.hides_keys(variants):
        kc.poison_outside_windows(batch, variants.get("window"), variants.get("attention_chunk"))
    plan = cpu_isa.detected_plan()
    tiles = _attend_bf16(batch, **variants)
    with using_plan(without_tiles(plan)):
        vectors = _attend_bf16(batch, **variants)
    expected = kc.naive_attention(batch, **variants)
    assert not tiles.isnan().any()
    assert kc.max_abs_err(tiles, expected) <= kc.ATOL[torch.bfloat16]
    starts = batch.query_start_loc.tolist()
    for s, (_, query_len) in enumerate(TILE_SPECS):
        rows = slice(starts[s], starts[s + 1])
        same = torch.equal(tiles[rows], vectors[rows])
        if query_len < plan.tile_min_rows["attention"]:
            assert same, (s, query_len)  # the vector body both times
        elif query_len >= 64:  # long rows: some bf16 output rounds apart (short ones may all agree)
            assert not same, (s, query_len)


@needs_tiles
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "swiglu_oai"])
@pytest.mark.parametrize("rows, width, in_features", [(6, 16, 64), (33, 1536, 576), (300, 96, 128)])
def test_a_gated_product_on_tiles_is_the_product_then_the_activation_bit_for_bit(activation, rows, width,
                                                                                 in_features):
    """act(gate) * up as the gate_up product's columns leave the tiles: the bits of the bf16
    product followed by NativeOps.gated_mul (the same arithmetic, simd.h's gated16), bias or none."""
    from workers.layer_ops import NativeOps

    native, ops = NativeLinear(), NativeOps()
    generator = torch.Generator().manual_seed(rows + width)
    weight = native.pack((torch.randn(2 * width, in_features, generator=generator) * 0.2).to(torch.bfloat16))
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    for bias in (None, torch.randn(2 * width, generator=generator).to(torch.bfloat16)):
        fused = native.gated_product(x, weight, bias, activation)
        assert fused is not None and fused.shape == (rows, width)
        assert torch.equal(fused, ops.gated_mul(native.linear(x, weight, bias), activation))
    assert native.gated_product(x[:1], weight, None, activation) is None  # below the table's rows: two steps
    with using_plan(without_tiles(cpu_isa.detected_plan())):
        assert native.gated_product(x, weight, None, activation) is None


@needs_tiles
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_0, GGMLType.Q4_1], ids=lambda t: t.name)
def test_the_int8_mode_on_int8_tiles_is_the_vector_kernels_bit_for_bit(ggml_type):
    """Packed Q4_0 and Q4_1: the integer dot products on int8 tiles, the fp32 scaling per block as
    the vector kernels do it, so every row count, dtype and bias gives their bits (a row's result
    the same on tiles or not, alone or in a batch); and the dispatch takes them from the table's
    rows to the bf16 tiles' (gguf_linear)."""
    weight = pack_columns(random_gguf_weight(ggml_type, 80, 576, seed=int(ggml_type)))
    generator = torch.Generator().manual_seed(2)
    for rows in (1, 15, 16, 17, 63, 64, 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 576, generator=generator).to(dtype)
            for bias in (None, torch.randn(80, generator=generator).to(dtype)):
                assert torch.equal(gguf.amx_int8_gemm(x, weight, bias), gguf.gguf_gemm(x, weight, bias, mode="int8"))
    plan = cpu_isa.detected_plan()
    first, bf16_from = plan.tile_min_rows["gguf_int8"], plan.tile_min_rows["gguf"]
    assert gguf.int8_tiles_take(weight, first) and not gguf.int8_tiles_take(weight, first - 1)
    assert not gguf.int8_tiles_take(weight, bf16_from) and gguf.tiles_take(weight, bf16_from)
    assert not gguf.int8_tiles_take(weight, first, mode="fp32")


@needs_tiles
def test_the_int16_mode_on_int8_tiles_is_the_vector_kernels_bit_for_bit():
    """A packed Q8_0 lm_head: x's int16 blocks cut into high and low bytes, two int8 tile products a
    block whose sums rejoin exactly, then the vectors' fp32 scaling, so every row count, dtype, bias
    and output dtype gives the int16 mode's bits (rows of 16 or fewer keep their sums in registers,
    more go through memory; 96 columns: an odd number of 16-column groups, the last one prefetching
    nothing). Extreme x (one huge value a block, zeros) exercises the high byte's sign."""
    weight = pack_columns(random_gguf_weight(GGMLType.Q8_0, 96, 1024, seed=8))
    generator = torch.Generator().manual_seed(4)
    for rows in (1, 2, 15, 16, 17, 33, 300):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 1024, generator=generator)
            x[:, ::32] *= 50.0
            x[0, 32:64] = 0.0
            x = x.to(dtype)
            for bias in (None, torch.randn(96, generator=generator).to(dtype)):
                for out_dtype in (torch.float32, dtype):
                    tiles = gguf.amx_int16_gemm(x, weight, bias, out_dtype=out_dtype)
                    assert torch.equal(tiles, gguf.gguf_gemm(x, weight, bias, out_dtype=out_dtype, mode="int16"))


@needs_tiles
def test_a_q8_0_lm_head_takes_the_int16_tiles_from_the_tables_rows():
    """gguf_logits (the int16 mode) runs on the tiles from TILE_MIN_ROWS["gguf_int16"] rows and on the
    vectors below, with the same bits; never a layer's int8 product, nor an unpacked head."""
    head = pack_columns(random_gguf_weight(GGMLType.Q8_0, 64, 256, seed=9))
    first = cpu_isa.detected_plan().tile_min_rows["gguf_int16"]
    assert gguf.int16_tiles_take(head, first, mode="int16") and not gguf.int16_tiles_take(head, first - 1, mode="int16")
    assert not gguf.int16_tiles_take(head, first) and not gguf.int16_tiles_take(head, first, mode="int8")
    assert not gguf.int16_tiles_take(unpack_columns(head), first, mode="int16")
    with using_plan(without_tiles(cpu_isa.detected_plan())):
        assert not gguf.int16_tiles_take(head, first, mode="int16")
    generator = torch.Generator().manual_seed(5)
    for rows in (first - 1, first, 2 * first):
        x = torch.randn(rows, 256, generator=generator)
        assert torch.equal(gguf_logits(x, head), gguf.gguf_gemm(x, head, out_dtype=torch.float32, mode="int16"))


@needs_tiles
def test_the_int16_tiles_refuse_a_weight_that_is_not_a_packed_q8_0():
    """The entry point refuses what it does not compute (status 1), so a caller falls back."""
    weight = pack_columns(random_gguf_weight(GGMLType.Q4_1, 32, 64, seed=1))
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="status 1"):
        gguf.amx_int16_gemm(x, weight)


@needs_tiles
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_a_gguf_gated_product_on_tiles_is_the_product_then_the_activation_bit_for_bit(ggml_type):
    """A GGUF gate_up weight's chunks dequantized gates first, ups after: act(gate) * up as the
    tiles leave them, the bits of the tile product and then gated_mul, in fp32 (unrounded, a GGUF
    model's activations) and bf16."""
    from workers.layer_ops import NativeOps

    in_features = 512 if ggml_type == GGMLType.Q4_K else 576
    weight = random_gguf_weight(ggml_type, 2 * 96, in_features, seed=5, std=0.1)
    variants = [weight] + ([pack_columns(weight)] if ggml_type in PACKABLE_TYPES else [])
    generator = torch.Generator().manual_seed(9)
    for w in variants:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(100, in_features, generator=generator).to(dtype)
            bias = torch.randn(192, generator=generator).to(dtype)
            for activation in ("silu", "gelu_tanh"):
                fused = gguf.amx_gated_gemm(x, w, bias, activation)
                assert torch.equal(fused, NativeOps().gated_mul(gguf.amx_gemm(x, w, bias), activation))


class _FakeBuild:
    """A build's entry points as plan_from reads them: an AMX CPU whose OS answers `answer`."""

    def __init__(self, answer: int) -> None:
        self.answer = answer

    def rayllm_cpu_features(self) -> int:
        return sum(cpu_isa.FEATURE_BITS.values())

    def rayllm_amx_enable(self) -> int:
        return self.answer

    def rayllm_vector_width(self) -> int:
        return 16

    def rayllm_panel_gemm_bf16_available(self) -> int:
        return 1


def test_a_cpu_with_amx_whose_os_refuses_the_tiles_runs_the_vectors_and_says_why(monkeypatch):
    monkeypatch.delenv("RAYLLM_AMX", raising=False)
    refused = cpu_isa.plan_from(_FakeBuild(3))
    assert "amx_bf16" in refused.features and not refused.amx and "refused by the OS" in refused.amx_status
    assert refused.isa(torch.bfloat16, gguf=True) == {"products": "avx512-bf16 panels", "attention": "avx512-bf16",
                                                       "gguf": "avx512-vnni int8"}
    granted = cpu_isa.plan_from(_FakeBuild(0))
    assert granted.amx and granted.tiles_take("bf16", granted.tile_min_rows["bf16"])
