"""bench/bench_quant_gpu.py on CPU: it cannot time anything here, but a GPU machine is lent
rarely and briefly, so its argument parsing and its random weights (valid kernel-ready forms of
each format, at a small shape) must not fail there for a reason a CPU could have shown."""

from __future__ import annotations

import pytest
import torch

from bench import bench_quant_gpu as bench
from workers import quant_formats as qf


def test_arguments():
    args = bench.parse_args(["--batches", "1,16,64", "--formats", "awq,fp8", "--iters", "7"])
    assert args.batches == [1, 16, 64] and args.formats == ["bf16", "awq", "fp8"] and args.iters == 7
    defaults = bench.parse_args([])
    assert defaults.batches == [1, 64] and defaults.formats == list(bench.FORMATS)
    with pytest.raises(SystemExit):
        bench.parse_args(["--formats", "int3"])


def test_llama_shapes():
    assert [(n, k) for _, n, k, _ in bench.LLAMA_8B_SHAPES] == [(4096, 4096), (1024, 4096), (14336, 4096),
                                                                 (4096, 14336)]
    assert sum(repeats for *_, repeats in bench.LLAMA_8B_SHAPES) == 7  # q, k, v, o, gate, up, down


@pytest.mark.parametrize("fmt", bench.FORMATS)
def test_random_weights_are_valid_kernel_forms(fmt):
    weight = bench.build_weight(fmt, 64, 256, "cpu")
    dense = qf.dequantize(weight)
    assert dense.shape == (64, 256) and torch.isfinite(dense).all() and dense.abs().max() > 0
    expected_bytes = {"bf16": 64 * 256 * 2, "awq": 64 * 256 // 2, "gptq": 64 * 256 // 2, "mxfp4": 64 * 256 // 2,
                      "awq-nosplit": 64 * 256 // 2, "mxfp4-nosplit": 64 * 256 // 2}
    if fmt in expected_bytes:
        assert bench.weight_bytes(weight) >= expected_bytes[fmt]
    if fmt != "bf16":
        assert not isinstance(weight, torch.Tensor)


def test_main_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        bench.main(["--batches", "1"])


def test_tune_arguments_and_candidates():
    from bench import tune_quant_gpu as tune
    from workers.kernels.triton_quant import Tiles

    args = tune.parse_args(["--kernels", "awq,fp8-w8a8", "--batches", "1,64"])
    assert args.kernels == ["awq", "fp8-w8a8"] and args.batches == [1, 64]
    with pytest.raises(SystemExit):
        tune.parse_args(["--kernels", "int3"])
    for kernel in tune.KERNELS:
        for batch in (1, 64):
            tiles = [Tiles(*t) for t in tune.candidates(kernel, batch)]
            assert len(set(tiles)) == len(tiles) and all(t.block_n % 8 == 0 and t.block_k % 32 == 0 for t in tiles)
            one_row = batch == 1 and kernel in tune.PACKED_KERNELS
            assert {t.block_m for t in tiles} == ({1, 16} if one_row else {16 if batch == 1 else 64})
            assert any(t.packed_loads for t in tiles) == (kernel in tune.PACKED_KERNELS)
            chosen = [Tiles(*t) for t in tune.candidates(kernel, batch, 4096, chosen=True)]
            assert len(chosen) == 1 and chosen[0] in tiles  # the launchers' choice is a candidate
        assert tune.weight_format(kernel) in bench.FORMATS
