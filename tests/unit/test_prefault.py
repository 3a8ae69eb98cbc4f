"""A GEMM output populated before its blocks arrive (`cleave_ps.fleet.prefault`) keeps its contents, is
populated where Linux can (5.14 and later: this machine), and small or GPU tensors are left alone."""

from __future__ import annotations

import platform

import pytest
import torch

from cleave_ps.fleet import prefault


@pytest.mark.parametrize("huge", [True, False])
def test_populating_keeps_the_contents(huge):
    t = torch.arange(3 << 20, dtype=torch.float32)[1:]  # (an offset start: not page aligned)
    want = t.clone()
    populated = prefault.prefault(t, huge)
    assert torch.equal(t, want)
    if platform.system() == "Linux" and tuple(map(int, platform.release().split(".")[:2])) >= (5, 14):
        assert populated


def test_only_large_cpu_tensors_are_populated():
    assert prefault.wanted(torch.empty(prefault.MIN_BYTES // 4))
    assert not prefault.wanted(torch.empty(prefault.MIN_BYTES // 4 - 1))
    if torch.cuda.is_available():
        assert not prefault.wanted(torch.empty(prefault.MIN_BYTES, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fresh_output_filled_after_populating_holds_the_blocks(dtype):
    out = torch.empty(2048, 2048, dtype=dtype)
    assert prefault.wanted(out)
    prefault.prefault(out)
    out[:1024, 1024:] = 1.5
    out[1024:, :1024] = -2.0
    assert float(out[:1024, 1024:].float().sum()) == 1.5 * 1024 * 1024
    assert float(out[1024:, :1024].float().sum()) == -2.0 * 1024 * 1024
