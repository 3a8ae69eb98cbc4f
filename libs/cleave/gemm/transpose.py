"""A matrix's transpose as a contiguous tensor, the copy made a band of rows at a time.

The backward's GEMMs take transposes (dYᵀ and Xᵀ for the weight gradient, Wᵀ for the input gradient).
PyTorch's `t.t().contiguous()` on the CPU walks the whole matrix with one stride, which leaves the cache at
every element for a matrix of a few MB; copying BAND_ROWS rows at a time (their bytes contiguous and in
cache, written as runs of BAND_ROWS elements) gives the same bytes 1.4 to 3 times faster, in float32 and
bfloat16, from 768 x 768 to 8192 x 4096 (2048 x 3072 float32: 3.3 against 9.7 ms; `benchmarks/transpose.py`,
`transpose.json`). A copy either way: the values are the same bits.
"""

from __future__ import annotations

import torch

BAND_ROWS = 64  # of the matrix (columns of its transpose): the fastest of 32, 64 and 128 at every shape tried


def transposed(t: torch.Tensor) -> torch.Tensor:
    """`t.t().contiguous()` of a 2-D tensor, equal to it bit for bit; banded where that is faster (a
    row-major CPU tensor outside autograd's recording), else PyTorch's own."""
    tt = t.t()
    if (tt.is_contiguous() or t.device.type != "cpu" or not t.is_contiguous() or t.shape[0] <= BAND_ROWS
            or (t.requires_grad and torch.is_grad_enabled())):
        return tt.contiguous()
    out = torch.empty(tt.shape, dtype=t.dtype)
    for r in range(0, t.shape[0], BAND_ROWS):
        out[:, r : r + BAND_ROWS].copy_(t[r : r + BAND_ROWS].t())
    return out
