"""A matrix's transpose as a contiguous tensor, the copy made a band of rows at a time.

The backward's GEMMs take transposes (dYᵀ and Xᵀ for the weight gradient, Wᵀ for the input gradient).
PyTorch's `t.t().contiguous()` on the CPU walks the whole matrix with one stride, which leaves the cache at
every element for a matrix of a few MB; copying a band of rows at a time (their bytes contiguous and in
cache, written as runs of the band's length) gives the same bytes faster, in float32 and bfloat16: 64 rows
(`BAND_ROWS`) for a matrix of 1024 columns or more (2048 x 3072 float32: 3.3 against 9.7 ms), and as many
more as make the band BAND_ROWS x 1024 elements for a narrower one, the activations of a small model
(8192 x 128: 512 rows a band, as fast as PyTorch's copy, where bands of 64 rows took twice its time;
`benchmarks/transpose.py`, `transpose.json`). A copy either way: the values are the same bits.
"""

from __future__ import annotations

import torch

BAND_ROWS = 64  # of the matrix (columns of its transpose): the fastest of 32, 64 and 128 at 768 columns and more
BAND_COLS = 1024  # a narrower matrix's band has BAND_ROWS x BAND_COLS // columns rows (its runs that much longer)


def band_rows(columns: int) -> int:
    """Rows a band of a matrix with `columns` columns: BAND_ROWS, times BAND_COLS // columns where that is 2 or more."""
    return BAND_ROWS * max(1, BAND_COLS // max(columns, 1))


def transposed(t: torch.Tensor) -> torch.Tensor:
    """`t.t().contiguous()` of a 2-D tensor, equal to it bit for bit; banded where that is faster (a
    row-major CPU tensor outside autograd's recording), else PyTorch's own."""
    tt = t.t()
    if (tt.is_contiguous() or t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] <= BAND_ROWS
            or (t.requires_grad and torch.is_grad_enabled())):
        return tt.contiguous()
    out = torch.empty(tt.shape, dtype=t.dtype)
    band = band_rows(t.shape[1])
    for r in range(0, t.shape[0], band):
        out[:, r : r + band].copy_(t[r : r + band].t())
    return out
