"""bench.step_breakdown's byte accounting, on the tiny random model: the KV a decode step reads
is what the runner's pools hold for its sequences, and the byte floor follows from it."""

from __future__ import annotations

import pytest
import torch

from bench import step_breakdown
from workers.model_runner import ModelRunner, RunnerConfig


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_bytes_are_the_pools_bytes_for_the_timed_contexts(tiny_model_dir, dtype: str) -> None:
    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), dtype=dtype, num_blocks=16))
    k_cache, v_cache = runner.kv_caches[0]
    pool_bytes_per_token = sum(cache[0].numel() * cache.element_size() for cache in (k_cache, v_cache)) / runner.block_size
    # 3 sequences of 20 prompt tokens; 4 timed steps after the warm one see 22..25 keys, mean 23.5
    expected = 3 * 23.5 * pool_bytes_per_token * len(runner.kv_caches)
    assert step_breakdown.kv_bytes(runner, batch=3, prompt_len=20, num_steps=4) == int(expected)


def test_a_breakdown_row_shows_the_byte_floor() -> None:
    row = step_breakdown.Breakdown("bfloat16", 2, 16, step_s=0.0172, gemm_s=0.0130, attention_s=0.0046,
                                   weight_read_s=0.0100, weight_bytes=270_000_000, kv_bytes=100_000_000)
    assert row.byte_floor == pytest.approx(370 / 270)
    text = row.row()
    assert "1.37" in text and "100 MB (27.0%)" in text and len(text.split("|")) == len(step_breakdown.HEADER.split("|"))


def test_run_prints_a_row_per_batch_with_its_kv(tiny_model_dir, capsys) -> None:
    torch.manual_seed(0)
    results = step_breakdown.run(str(tiny_model_dir), ["float32"], [1], [1, 2], prompt_len=16, num_steps=2, repeats=1)
    assert [r.batch for r in results] == [1, 2]
    assert results[1].kv_bytes == 2 * results[0].kv_bytes > 0
    assert all(r.byte_floor > 1 for r in results)
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


def test_a_gguf_breakdown_runs_the_served_dtype_unless_told_otherwise() -> None:
    from bench.bench_runner import DEFAULT_DTYPES, breakdown_dtypes

    assert breakdown_dtypes(DEFAULT_DTYPES, "auto") == ["auto"]  # fp32 activations, fp16 pool: what ships
    assert breakdown_dtypes(DEFAULT_DTYPES, "none") == ["float32", "bfloat16"]
    assert breakdown_dtypes("bfloat16", "auto") == ["bfloat16"]


def test_a_prompt_steps_product_flop_are_twice_its_weights_multiply_adds(tiny_model_dir) -> None:
    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), dtype="float32", num_blocks=16))
    config = runner.model_config
    layer_weights = sum(config.hidden_size * n for n in (  # every projection's in x out
        (config.num_heads + 2 * config.num_kv_heads) * config.head_dim, 2 * config.intermediate_size))
    layer_weights += (config.num_heads * config.head_dim + config.intermediate_size) * config.hidden_size
    products, attention = step_breakdown.prompt_step_flop(config, num_seqs=3, prompt_len=4)
    assert products == 2 * (3 * 4 * config.num_layers * layer_weights + 3 * config.hidden_size * config.vocab_size)
    # 1 + 2 + 3 + 4 keys seen; QK^T and PV, 2 FLOP a multiply-add
    assert attention == 2 * 2 * config.num_layers * 3 * config.num_heads * config.head_dim * 10


def test_a_prompt_row_states_its_rates_against_the_tiles_peak_where_there_is_one() -> None:
    row = step_breakdown.PrefillBreakdown("bfloat16", 2, 16, 256, step_s=1.0, gemm_s=0.5, attention_s=0.2,
                                          product_flop=1.5e12, attention_flop=0.5e12, tile_peak_tflops=6.0)
    assert "products 3.00 TFLOP/s, step 2.00 TFLOP/s: 50% and 33% of the tiles' peak (6.00" in row.row()
    without = step_breakdown.PrefillBreakdown("bfloat16", 2, 16, 256, 1.0, 0.5, 0.2, 1.5e12, 0.5e12, None)
    assert "peak" not in without.row()


def test_the_tile_peak_is_measured_where_the_tiles_run_and_none_elsewhere() -> None:
    from bench.tile_peak import tile_peak_tflops
    from workers.kernels import cpu_isa
    from workers.kernels.native import native_available

    peak = tile_peak_tflops(2, seconds=0.05)
    if native_available() and cpu_isa.detected_plan().amx:
        assert peak is not None and 0 < peak < 1000
    else:
        assert peak is None
