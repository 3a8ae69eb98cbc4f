"""Mixed precision (cleave.train.precision): the tiles' rule (half inputs, float32 over the whole K, one rounding)
gives the reference's products bit for bit; fp16's loss scale skips an overflowing step as GradScaler does."""

from __future__ import annotations

import pytest
import torch

from cleave.errors import ConfigError
from cleave.gemm.tiled import LocalTiles
from cleave.train.job import JobConfig
from cleave.train.precision import DEFAULT_INIT_SCALE, LossScaler
from cleave.train.trainer import Trainer
from cleave_cli.commands import job_from_args
from cleave_cli.main import build_parser

STEPS = 3


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiles_equal_the_reference_bit_for_bit(precision):
    job = JobConfig(preset="tiny", batch_size=4, precision=precision)
    ref, tiled = Trainer(job), Trainer(job, LocalTiles(48, 80))  # ragged blocks, as a plan cuts them
    want = [ref.step(s) for s in range(STEPS)]
    assert [tiled.step(s) for s in range(STEPS)] == want
    for p, q in zip(ref.model.parameters(), tiled.model.parameters(), strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q)  # fp32 master weights, equal
    fp32 = Trainer(JobConfig(preset="tiny", batch_size=4)).step(0)
    assert want[0] != fp32 and abs(want[0] - fp32) < 1e-2 * fp32  # a different precision, close


def test_saved_activations_and_gemm_inputs_are_in_the_low_precision():
    seen = []

    class Spy(LocalTiles):
        def gemm(self, a, bt, name):
            seen.append((name, a.dtype, bt.dtype))
            out = super().gemm(a, bt, name)
            assert out.dtype == a.dtype
            return out

    trainer = Trainer(JobConfig(preset="tiny", batch_size=2, precision="bf16"), Spy())
    trainer.step(0)
    assert {kind for name, *_ in seen for kind in [name.rsplit(".", 1)[1]]} == {"fwd", "dx", "dw"}
    assert all(a == b == torch.bfloat16 for _, a, b in seen)
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.opt.state.values())


def test_fp16_overflow_skips_the_step_and_halves_the_scale_in_both_paths():
    job = JobConfig(preset="tiny", batch_size=4, precision="fp16")
    ref, tiled = Trainer(job), Trainer(job, LocalTiles(48, 80))
    for t in (ref, tiled):
        t.opt.param_groups[0]["loss_scale"] = 2.0**18  # the first steps' gradients overflow fp16
    before = [p.detach().clone() for p in ref.model.parameters()]
    assert ref.step(0) == tiled.step(0)
    assert ref.skipped == tiled.skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(ref.model.parameters(), before, strict=True))  # not applied
    assert ref.scaler.value == tiled.scaler.value == 2.0**17
    assert [tiled.step(s) for s in range(1, 5)] == [ref.step(s) for s in range(1, 5)]
    assert ref.skipped == tiled.skipped < 5 and ref.scaler.value == tiled.scaler.value  # it recovered


def test_the_scale_grows_after_clean_steps_and_persists_with_the_optimizer():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p])
    scaler = LossScaler(opt, growth_interval=2)
    assert scaler.value == DEFAULT_INIT_SCALE
    for _ in range(2):
        p.grad = torch.full((2,), DEFAULT_INIT_SCALE)
        assert scaler.unscale() and torch.equal(p.grad, torch.ones(2))
        scaler.update(False)
    assert scaler.value == 2 * DEFAULT_INIT_SCALE
    p.grad = torch.tensor([1.0, float("inf")])
    assert not scaler.unscale()
    scaler.update(True)
    state = opt.state_dict()["param_groups"][0]
    assert state["loss_scale"] == DEFAULT_INIT_SCALE and state["loss_scale_clean_steps"] == 0
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    fresh.load_state_dict(opt.state_dict())
    assert LossScaler(fresh).value == DEFAULT_INIT_SCALE  # restored, not reset


def test_precision_is_a_validated_setting_and_a_flag():
    assert job_from_args(build_parser().parse_args(["train", "--preset", "tiny", "--precision", "bf16"])).precision == "bf16"
    with pytest.raises(ConfigError, match="precision"):
        JobConfig.build(preset="tiny", precision="int8")
    with pytest.raises(ConfigError, match="precision='fp16' does not apply to method='split'"):
        JobConfig.build(preset="tiny", method="split", precision="fp16")
    assert JobConfig.build(preset="tiny", method="diloco", precision="fp16").precision == "fp16"  # rounds train in it


def test_the_ps_refuses_the_approximate_tile_dtype_with_a_precision():
    from cleave_ps.jobs.pretrain import fit, wire_bytes  # noqa: PLC0415 - the PS service, only for this test
    from cleave_ps.settings import PsSettings  # noqa: PLC0415

    job = JobConfig(preset="tiny", precision="bf16")
    with pytest.raises(ConfigError, match="CLEAVE_PS_TILE_DTYPE=fp16 is the approximate mode of an fp32 job"):
        fit(PsSettings(tile_dtype="fp16"), job)
    assert wire_bytes(PsSettings(), job) == 2
    assert wire_bytes(PsSettings(), JobConfig(preset="tiny")) == 4


def test_the_loss_scale_survives_the_streamed_checkpoint():
    from cleave.train.checkpoint import encode, restore, snapshot  # noqa: PLC0415 - the PS's checkpoint format

    job = JobConfig(preset="tiny", batch_size=2, seq_len=16, precision="fp16")
    src, dst = Trainer(job), Trainer(job)
    src.opt.param_groups[0]["loss_scale"] = 2.0**18
    for s in range(2):
        src.step(s)  # both overflow: the scale halves twice
    data, m = encode(snapshot(src.model, src.opt, "j", 1, 1), 4096)
    restore(dst.model, dst.opt, data, m)
    assert dst.scaler.value == src.scaler.value == 2.0**16
    assert src.step(2) == dst.step(2) and src.scaler.value == dst.scaler.value
