"""The model zoo and the tiled linear layers: shapes, presets, and exact gradients through tiles."""

import math

import pytest
import torch

from cleave.gemm.tiled import LocalTiles, TiledLinear, install
from cleave.models import PRESETS, ModelConfig, build_model, gemm_shapes, get_preset
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "small"])
def test_forward_shapes_and_determinism(preset):
    cfg = get_preset(preset)
    m1, m2 = build_model(cfg, seed=3), build_model(cfg, seed=3)
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    out = m1(idx)
    assert out.shape == (2, 16, cfg.vocab_size)
    assert torch.equal(out, m2(idx))


def test_published_shapes_build_on_meta():
    assert sum(p.numel() for p in build_model(PRESETS["gpt2-medium"], device="meta").parameters()) == pytest.approx(355e6, rel=0.02)
    assert sum(p.numel() for p in build_model(PRESETS["llama3-1b"], device="meta").parameters()) == pytest.approx(1.236e9, rel=0.02)


def test_gemm_shapes_cover_every_linear_three_times():
    cfg = get_preset("tiny")
    shapes = gemm_shapes(cfg, batch=4, seq=32)
    per_layer = {s.name.rsplit(".", 1)[0] for s in shapes}
    assert per_layer == {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj", "lm_head"}
    fwd = {s.name: s for s in shapes}
    assert (fwd["mlp.c_fc.fwd"].m, fwd["mlp.c_fc.fwd"].n, fwd["mlp.c_fc.fwd"].k) == (128, 256, 64)
    assert (fwd["mlp.c_fc.dw"].m, fwd["mlp.c_fc.dw"].n, fwd["mlp.c_fc.dw"].k) == (256, 64, 128)
    assert fwd["mlp.c_fc.fwd"].count_per_step == cfg.n_layer


def test_config_errors_name_the_knob():
    with pytest.raises(ValueError, match="n_head"):
        ModelConfig(n_embd=65, n_head=2)
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("nope")


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_tiled_linears_give_the_same_loss_and_gradients(preset):
    cfg = get_preset(preset)
    ref, dist = build_model(cfg, seed=0), build_model(cfg, seed=0)
    install(dist, LocalTiles(24, 40))
    assert all(type(m) is TiledLinear for n, m in dist.named_modules() if n.endswith(("proj", "c_fc", "c_attn", "lm_head")))
    assert dist.state_dict().keys() == ref.state_dict().keys()
    idx = torch.randint(0, cfg.vocab_size, (3, 20))
    for m in (ref, dist):
        m(idx).logsumexp(-1).mean().backward()
    for (name, p), q in zip(ref.named_parameters(), dist.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_tiny_step_is_a_few_dozen_megaflops():
    """The preset tests train on: a step's GEMMs (all of them, forward and backward) stay tiny, whatever the
    machine's speed (a step of it takes milliseconds on a laptop core)."""
    job = JobConfig(preset="tiny")
    flops = sum(g.flops * g.count_per_step for g in gemm_shapes(get_preset("tiny"), job.batch_size, job.seq))
    assert flops < 1e9
    assert math.isfinite(Trainer(job).step(0))
