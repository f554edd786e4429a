"""The linear backends (F.linear, oneDNN-prepacked) agree, and bad choices fail clearly."""

from __future__ import annotations

import pytest
import torch

from workers.linear import onednn_available, select_linear_backend

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


def test_auto_selection_and_errors():
    expected = "onednn" if onednn_available(torch.device("cpu"), torch.float32) else "torch"
    assert select_linear_backend(None, "cpu", torch.float32).name == expected
    assert select_linear_backend(None, "cpu", torch.float16).name == "torch"
    assert select_linear_backend("torch", "cpu", torch.float32).name == "torch"
    with pytest.raises(ValueError, match="needs a CPU device"):
        select_linear_backend("onednn", "cpu", torch.float16)
    with pytest.raises(ValueError, match="unknown linear backend"):
        select_linear_backend("blas", "cpu", torch.float32)
