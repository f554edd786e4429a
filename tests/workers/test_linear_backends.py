"""The linear backends (F.linear, oneDNN-prepacked, oneDNN + our C GEMV) agree, and bad
choices fail clearly."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from workers.kernels.native import LINEAR_PANELS, native_available, native_library
from workers.linear import (GEMV_MAX_ROWS, onednn_available, pack_panels, pack_panels_bf16,
                            select_linear_backend)

needs_onednn = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32),
                                  reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 16, 300])
def test_onednn_matches_f_linear(rows):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    weight = torch.randn(200, 96, generator=generator)
    bias = torch.randn(200, generator=generator)
    onednn = select_linear_backend("onednn", "cpu", torch.float32)
    packed = onednn.pack(weight)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double()).float()
    torch.testing.assert_close(onednn.linear(x, packed, bias), expected, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(onednn.linear(x, packed), expected - bias, atol=1e-4, rtol=1e-5)


ONEDNN_BF16 = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.bfloat16),
                                 reason="oneDNN's bf16 path needs AVX512BW or AVX-NE-CONVERT")
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=6e-2, rtol=2e-2)}


def assert_products(native, x, weight, packed, bias) -> None:
    """linear (with bias, in the input dtype) and logits (no bias, fp32) against float64."""
    expected = x.double() @ weight.double().T
    out = native.linear(x, packed, bias)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], weight.shape[0])
    torch.testing.assert_close(out.double(), expected + bias.double(), **TOLERANCE[x.dtype])
    logits = native.logits(x, packed)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), expected, **TOLERANCE[x.dtype])


@needs_onednn
@pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=ONEDNN_BF16)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 9])
def test_native_gemv_and_gemm_agree(rows, dtype):
    """Up to GEMV_MAX_ROWS rows take the C GEMV over the plain weight, more the packed GEMM:
    the same products, in the input dtype (linear) and in fp32 (logits)."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=generator).to(dtype)
    weight = torch.randn(1001, 72, generator=generator).to(dtype)  # no multiple of the GEMV's tiles
    bias = torch.randn(1001, generator=generator).to(dtype)
    native = select_linear_backend("native", "cpu", dtype)
    assert_products(native, x, weight, native.pack(weight), bias)


PANEL_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=ONEDNN_BF16)]


def has_panels_for(native, dtype: torch.dtype) -> bool:
    """fp32 panels on AVX2 (layer_ops.c) or AVX-512 (panel_avx512.c), bf16 panels on AVX512_BF16 (panel_avx512.c)."""
    return native.has_panels if dtype == torch.float32 else native.has_bf16_panels


def panel_row_counts(native, dtype: torch.dtype) -> list[int]:
    max_rows = native.panel_max_rows[dtype]
    limit = {max_rows, max_rows + 1} if max_rows is not None else {191, 192, 193, 500}  # row spans past 192
    return sorted({1, 2, 3, 5, 6, 8, 16, 17, 48, 49, 64, 65} | limit)


@needs_onednn
@pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")
@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=["fp32", "bf16"])
def test_panel_gemm_matches_float64(dtype):
    """fp32 weights on a CPU with AVX2 or AVX-512, and bf16 weights on one with AVX512_BF16,
    are packed in panels of 16 columns, and up to the dtype's row limit the panel GEMM takes
    the product (row tiles of up to 6 over up to 4 panels, a last panel cut short, rows in
    chunks); more rows take oneDNN. Elsewhere the GEMV/oneDNN split above holds and this
    checks the same products through it."""
    native = select_linear_backend("native", "cpu", dtype)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1001, 72, generator=generator).to(dtype)  # 62 full panels and one of 9 columns
    bias = torch.randn(1001, generator=generator).to(dtype)
    packed = native.pack(weight)
    assert (packed.native_operand().linear == LINEAR_PANELS) == has_panels_for(native, dtype)  # packed as panels
    for rows in panel_row_counts(native, dtype):
        assert_products(native, torch.randn(rows, 72, generator=generator).to(dtype), weight, packed, bias)
        strided = torch.randn(rows, 144, generator=generator).to(dtype)[:, ::2]  # a view, as the model passes some
        torch.testing.assert_close(native.linear(strided, packed).double(), strided.double() @ weight.double().T,
                                   **TOLERANCE[dtype])


@needs_onednn
@pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")
@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("threads", [1, 2])
def test_panel_gemm_rows_are_the_same_in_every_batch(threads, dtype):
    """A row's product does not depend on the rows beside it (tile shapes, panel groups,
    k-blocking and row chunks vary with the row count, the summation order does not), so a
    sequence decodes the same tokens alone and in a batch; the logits (fp32 out) too."""
    native = select_linear_backend("native", "cpu", dtype)
    if not has_panels_for(native, dtype):
        pytest.skip(f"this CPU's kernels have no {dtype} panel GEMM")
    generator = torch.Generator().manual_seed(threads)
    x = torch.randn(400, 260, generator=generator).to(dtype)  # fp32: k blocks of 64 (x4) and 4; bf16: pairs 64, 64, 2
    weight = native.pack(torch.randn(330, 260, generator=generator).to(dtype))  # 20 full panels and one of 10 columns
    # past 192 rows the rows are split over the threads too (panel_avx512.c), where the panels take them
    many = [rows for rows in (193, 250, 400) if weight.takes(rows)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([native.linear(x[row : row + 1], weight) for row in range(400)])
        alone_logits = torch.cat([native.logits(x[row : row + 1], weight) for row in range(400)])
        for rows in [*range(2, 10), 17, 47, 48, 49, 64, 65, 66, 97, 100, *many]:
            assert torch.equal(native.linear(x[:rows], weight), alone[:rows]), rows
            assert torch.equal(native.logits(x[:rows], weight), alone_logits[:rows]), rows
    finally:
        torch.set_num_threads(previous)


@needs_onednn
@pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")
@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=["fp32", "bf16"])
def test_panel_gemm_from_two_python_threads_at_once(dtype):
    """The kernels share one thread pool (csrc/thread_pool.c): a call arriving while another
    runs computes its items itself, and both get exact results (ctypes drops the GIL, so the
    two calls really overlap)."""
    native = select_linear_backend("native", "cpu", dtype)
    if not has_panels_for(native, dtype):
        pytest.skip(f"this CPU's kernels have no {dtype} panel GEMM")
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(2000, 64, generator=generator).to(dtype)
    packed = native.pack(weight)
    inputs = [torch.randn(rows, 64, generator=generator).to(dtype) for rows in (1, 2, 5, 16)]
    expected = [native.linear(x, packed) for x in inputs]
    mismatches = []

    def hammer() -> None:
        for _ in range(200):
            for x, want in zip(inputs, expected):
                if not torch.equal(native.linear(x, packed), want):
                    mismatches.append(x.shape[0])

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not mismatches


@pytest.mark.skipif(not native_available(), reason="the C kernels do not build here")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool's helpers and their futexes are Linux's")
def test_a_caller_sleeps_until_a_helper_that_lost_its_core_is_done():
    """With a busy process on every core, the pool's helper loses its core in the middle of items;
    the caller, its own items done, stops spinning and sleeps until the helper counts its last
    item (csrc/thread_pool.c, WAIT_SPINS), and wakes: every product exact, none left hanging (the
    suite's timeout), and such sleeps counted."""
    native = select_linear_backend("native", "cpu", torch.float32)
    generator = torch.Generator().manual_seed(11)
    weight = torch.randn(4096, 512, generator=generator)
    packed = native.pack(weight)
    x = torch.randn(128, 512, generator=generator)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = native.linear(x, packed)
        library = native_library()
        slept = library.rayllm_pool_caller_sleeps()
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
        try:
            for _ in range(60):
                assert torch.equal(native.linear(x, packed), expected)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        assert library.rayllm_pool_caller_sleeps() > slept
    finally:
        torch.set_num_threads(previous)


def test_pack_panels_layout():
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    panels = pack_panels(weight)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0, 2], weight[:16, 2]) and torch.equal(panels[1, 1, :4], weight[16:, 1])
    assert not panels[1, :, 4:].any()  # zeros past the last column


def test_pack_panels_bf16_layout():
    weight = torch.arange(20 * 4, dtype=torch.float32).reshape(20, 4).bfloat16()
    panels = pack_panels_bf16(weight)
    assert panels.shape == (2, 2, 16, 2)  # panels, k pairs, columns, pair
    assert torch.equal(panels[0, 1, :, 0], weight[:16, 2]) and torch.equal(panels[0, 1, :, 1], weight[:16, 3])
    assert torch.equal(panels[1, 0, :4, 1], weight[16:, 1])
    assert not panels[1, :, 4:].any()  # zeros past the last column


def test_auto_selection_and_errors():
    expected = "torch"
    if onednn_available(torch.device("cpu"), torch.float32):
        expected = "native" if native_available() else "onednn"
    assert select_linear_backend(None, "cpu", torch.float32).name == expected
    assert select_linear_backend(None, "cpu", torch.float16).name == "torch"
    if not onednn_available(torch.device("cpu"), torch.bfloat16):  # an AVX2-only CPU: bf16 on plain F.linear
        assert select_linear_backend(None, "cpu", torch.bfloat16).name == "torch"
        with pytest.raises(ValueError, match="AVX512BW"):
            select_linear_backend("onednn", "cpu", torch.bfloat16)
    assert select_linear_backend("torch", "cpu", torch.float32).name == "torch"
    with pytest.raises(ValueError, match="needs a CPU device"):
        select_linear_backend("onednn", "cpu", torch.float16)
    with pytest.raises(ValueError, match="needs a CPU device"):
        select_linear_backend("native", "cpu", torch.float16)
    with pytest.raises(ValueError, match="unknown linear backend"):
        select_linear_backend("blas", "cpu", torch.float32)
