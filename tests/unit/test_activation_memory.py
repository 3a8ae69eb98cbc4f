"""The PS's activation memory: recomputation per block, micro-batches, the head and loss in chunks of tokens.
Each is checked against the same-option reference (plain PyTorch) and against the job without it, and the
GEMMs a step really runs are the ones the planner is told about (`gemm_shapes` with the step's layout)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cleave.gemm.head import head_loss
from cleave.gemm.tiled import LocalTiles, _Computed
from cleave.models import StepLayout, build_model, gemm_shapes, gemms, get_preset, head_chunks
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer

CHUNKY = 64 * 256 * 4  # logits_bytes: tiny's 512 tokens of a 256-token vocabulary in 8 chunks


class Recording:
    """A GEMM backend that computes each product in one piece and records its (m, n, k)."""

    def __init__(self) -> None:
        self.calls: Counter[tuple[int, int, int]] = Counter()

    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        self.calls[(a.shape[0], bt.shape[0], a.shape[1])] += 1
        return a @ bt.T


class Deferring:
    """A backend that runs GEMMs "concurrently" as the PS's fleet does: the weight gradients are deferred
    (`cleave.gemm.tiled.LateGrads`) and added in at the end of each backward pass."""

    deferred_gemms = 8

    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        return a @ bt.T

    def submit(self, a: torch.Tensor, bt: torch.Tensor, name: str, priority: int = 0) -> _Computed:
        return _Computed(a @ bt.T)


def tiles() -> LocalTiles:
    return LocalTiles(256, 128)  # the PS's tiled products, in this process


def train(steps: int = 2, backend=None, **fields) -> tuple[list[float], Trainer]:  # noqa: ANN001
    job = JobConfig(**{"preset": "tiny", "steps": steps, **fields})
    trainer = Trainer(job, backend)
    return [trainer.step(i) for i in range(steps)], trainer


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_recomputation_is_bit_for_bit_the_same_training(preset: str) -> None:
    plain, a = train(preset=preset)
    again, b = train(preset=preset, recompute=True)
    assert again == plain
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
    tiled, c = train(preset=preset, recompute=True, backend=tiles())  # the PS's linear layers, tiled here
    tiled_plain, d = train(preset=preset, backend=tiles())
    assert tiled == tiled_plain
    assert all(torch.equal(p, q) for p, q in zip(c.model.parameters(), d.model.parameters(), strict=True))


@pytest.mark.parametrize(("preset", "precision"), [("tiny", "fp32"), ("tiny-llama", "fp32"), ("tiny", "bf16")])
def test_micro_batches_and_a_chunked_head_equal_their_same_option_reference(preset: str, precision: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemms, "HEAD_SLICE", 100)  # the head's input gradient over 3 slices of the vocabulary
    options = dict(preset=preset, precision=precision, micro_batches=4, logits_bytes=CHUNKY, recompute=True)
    ref, r = train(**options)
    tiled, t = train(backend=tiles(), **options)
    assert tiled == ref and r.layout == StepLayout(recompute=True, micro_batches=4, head_chunks=2, head_slices=3)
    whole, _ = train(preset=preset, precision=precision)  # accumulation sums in another order: the envelope
    rtol = 1e-6 if precision == "fp32" else 1e-4
    assert all(abs(a - b) <= rtol * abs(b) for a, b in zip(ref, whole, strict=True)), (ref, whole)


def test_deferred_weight_gradients_reach_the_parameters_of_a_recomputed_block() -> None:
    options = dict(preset="small", batch_size=4, recompute=True, micro_batches=2, logits_bytes=64 * 256 * 4)
    plain, p = train(**options)
    now, n = train(backend=Recording(), **options)  # the same products, each weight gradient when asked
    later, d = train(backend=Deferring(), **options)  # (a recomputed block's saved weight is a detached alias:
    assert later == now  # a .grad set on it would never reach the parameter)
    assert all(torch.equal(a, b) for a, b in zip(n.model.parameters(), d.model.parameters(), strict=True))
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(later, plain, strict=True))


@pytest.mark.parametrize("skipped", [0, 40])
def test_the_chunked_head_gives_the_whole_heads_loss_and_gradients(skipped: int) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 300, bias=False)
    h = torch.randn(96, 32, requires_grad=True)
    y = torch.randint(0, 300, (96,))
    y[torch.randperm(96)[:skipped]] = -100  # prompts and padding: no loss, no gradient, not in the mean
    want = torch.nn.functional.cross_entropy(head(h), y)
    want.backward()
    g_h, g_w = h.grad.clone(), head.weight.grad.clone()
    for chunks, slices in ((1, 1), (5, 3), (96, 300)):
        h.grad = head.weight.grad = None
        got = head_loss(head, h, y, chunks, slices)
        (got * 3.0).backward()  # a gradient other than the one it was computed for is multiplied in
        assert torch.allclose(got, want, rtol=1e-6)
        assert torch.allclose(h.grad, 3 * g_h, rtol=1e-5, atol=1e-7)
        assert torch.allclose(head.weight.grad, 3 * g_w, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        assert torch.allclose(head_loss(head, h, y, 7), want, rtol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("layout", [StepLayout(), StepLayout(recompute=True),
                                    StepLayout(micro_batches=2, head_chunks=4, head_slices=3),
                                    StepLayout(recompute=True, micro_batches=4, head_chunks=2, head_slices=2)])
def test_a_step_runs_exactly_the_gemms_the_planner_is_told_about(preset: str, layout: StepLayout,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = get_preset(preset)
    monkeypatch.setattr(gemms, "HEAD_SLICE", -(-cfg.vocab_size // layout.head_slices))  # tiny's 256 in slices
    tokens = 8 * 64 // layout.micro_batches
    logits = tokens // layout.head_chunks * cfg.vocab_size * 4
    job = JobConfig(preset=preset, recompute=layout.recompute, micro_batches=layout.micro_batches,
                    logits_bytes=logits)
    backend = Recording()
    trainer = Trainer(job, backend)
    assert trainer.layout == layout
    trainer.step(0)
    planned = Counter()
    for g in gemm_shapes(job.arch(), job.batch_size, job.seq, layout):
        planned[(g.m, g.n, g.k)] += g.count_per_step
    assert backend.calls == planned


def test_head_chunks_are_the_fewest_equal_pieces_under_the_budget() -> None:
    cfg = get_preset("gpt2-medium")
    assert head_chunks(cfg, 8192) == 8 and head_chunks(cfg, 1024) == 1
    assert head_chunks(cfg, 8192, logits_bytes=1) == 8192
    assert head_chunks(cfg, 3 * 1024, logits_bytes=1024 * cfg.vocab_size * 4) == 3


def test_only_the_blocks_are_recomputed_and_the_model_computes_the_same_logits() -> None:
    model = build_model(get_preset("tiny"), seed=0)
    x = torch.randint(0, 256, (2, 16))
    want = model(x)
    model.recompute = True
    assert torch.equal(model(x), want)
