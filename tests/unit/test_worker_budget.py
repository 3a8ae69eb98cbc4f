"""The worker's memory check and the planner agree: every block a plan gives a device passes the device's
own check, and a block larger than its memory allows is refused, naming the budget."""

from __future__ import annotations

import numpy as np
import torch

from cleave.plan.costmodel import tile_memory_bytes
from cleave.plan.planner import plan_gemm
from cleave_worker.core import check_inputs, tile_bytes
from tests.unit.test_planner import random_fleet


def blocks(rows: int, cols: int, k: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, k, dtype=dtype), torch.zeros(cols, k, dtype=dtype)


def test_every_planned_block_fits_its_workers_check():
    rng = np.random.default_rng(3)
    k = 96
    fleet = random_fleet(rng, 6, k, 4, mem_factor=60)  # small memories: many blocks at their limit
    plan = plan_gemm(fleet, 200, 150, k, 4)
    rows, cols = plan.row1 - plan.row0, plan.col1 - plan.col0
    for r, c, dev in zip(rows, cols, plan.dev, strict=True):
        a, bt = blocks(int(r), int(c), k)
        assert tile_bytes(a, bt) == int(tile_memory_bytes(np.array(r), np.array(c), k, 4))
        assert check_inputs(a, bt, int(fleet.memory_bytes[dev])) == ""
    tight = np.argmax(tile_memory_bytes(rows, cols, k, 4) / fleet.memory_bytes[plan.dev])
    a, bt = blocks(int(rows[tight]) + 1 + int(fleet.memory_bytes[plan.dev[tight]]) // (4 * k), int(cols[tight]), k)
    why = check_inputs(a, bt, int(fleet.memory_bytes[plan.dev[tight]]))
    assert f"over this worker's budget of {int(fleet.memory_bytes[plan.dev[tight]])}" in why


def test_half_precision_inputs_count_as_their_float32_copies():
    a, bt = blocks(64, 32, 128, torch.bfloat16)
    need = ((64 + 32) * 128 + 64 * 32) * 4
    assert tile_bytes(a, bt) == need
    assert check_inputs(a, bt, need) == "" and "needs 57344 bytes" in check_inputs(a, bt, need - 1)
