"""`cleave.gemm.transpose.transposed` is `t.t().contiguous()` bit for bit, whatever the shape, dtype or layout."""

from __future__ import annotations

import pytest
import torch

from cleave.gemm.transpose import BAND_COLS, BAND_ROWS, band_rows, transposed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 7), (BAND_ROWS, 5), (BAND_ROWS + 1, 3), (3 * BAND_ROWS + 17, 300), (700, 1),
                                   (3 * BAND_ROWS + 17, 2 * BAND_COLS), (2 * band_rows(128) + 5, 128)])
def test_the_same_bits_as_pytorchs_transpose(shape, dtype):
    t = torch.randn(*shape).to(dtype)
    got = transposed(t)
    want = t.t().contiguous()
    assert got.is_contiguous() and got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_a_narrow_matrix_is_copied_in_longer_bands():
    assert band_rows(4096) == band_rows(BAND_COLS) == band_rows(768) == BAND_ROWS
    assert band_rows(512) == 2 * BAND_ROWS and band_rows(384) == 2 * BAND_ROWS and band_rows(128) == 8 * BAND_ROWS


def test_views_and_recorded_tensors_as_pytorch_does():
    t = torch.randn(300, 200)
    assert transposed(t.t()).data_ptr() == t.data_ptr()  # a transposed view's transpose: no copy, as PyTorch
    sliced = t[:, 10:150]  # not contiguous: PyTorch's own copy
    assert torch.equal(transposed(sliced), sliced.t().contiguous())
    w = torch.randn(200, 100, requires_grad=True)
    out = transposed(w)  # recorded by autograd: the gradient flows back as through .t()
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones(200, 100))
