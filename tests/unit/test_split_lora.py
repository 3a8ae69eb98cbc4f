"""Split learning pinned to plain training at every step; LoRA adapters: identity at start, only they train."""

from __future__ import annotations

import pytest
import torch

from cleave.errors import ConfigError
from cleave.methods import common, fedavg, lora, split
from cleave.models import ModelConfig, build_model, get_preset
from cleave.train import schedule
from cleave.train.data import Corpus
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer

STEPS = 4
UNTIED = ModelConfig(family="gpt2", n_layer=2, n_head=2, n_embd=32, block_size=32, tie_embeddings=False)


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return Corpus()


def run_split(cfg: ModelConfig, job: JobConfig, corpus: Corpus, k: int) -> list[float]:
    client_half, server_half = split.split_model(build_model(cfg, seed=job.seed), k)
    client = split.SplitClient(client_half, common.make_adamw(client_half.parameters(), job), job.grad_clip)
    server = split.SplitServer(server_half, common.make_adamw(split.server_params(server_half), job))
    losses = []
    for s in range(STEPS):
        x, y = common.shard_batch(corpus, job, 0, s)
        schedule.set_lr(client.opt, job, s)
        schedule.set_lr(server.opt, job, s)
        back = server.step(client.forward(x), y)
        server.apply(client.backward(back))
        losses.append(back.loss)
    return losses


@pytest.mark.parametrize(("preset", "k"), [("tiny", 1), ("tiny-llama", 1), ("tiny", 0)])
def test_split_matches_reference_at_every_step(corpus: Corpus, preset: str, k: int) -> None:
    job = JobConfig(preset=preset, batch_size=4, seq_len=32, lr=1e-2)  # a large lr: the clip bites
    trainer = Trainer(job, corpus=corpus)
    ref = [trainer.step(s) for s in range(STEPS)]
    assert run_split(get_preset(preset), job, corpus, k) == pytest.approx(ref, rel=1e-4)


def test_split_of_an_untied_model_matches_plain_training(corpus: Corpus) -> None:
    job = JobConfig(preset="tiny", batch_size=4, seq_len=32)
    model = build_model(UNTIED, seed=job.seed)
    opt = common.make_adamw(model.parameters(), job)
    ref = []
    for s in range(STEPS):
        schedule.set_lr(opt, job, s)
        ref.append(common.train_step(model, opt, common.shard_batch(corpus, job, 0, s), job.grad_clip))
    assert run_split(UNTIED, job, corpus, 2) == pytest.approx(ref, rel=1e-4)


def test_split_halves_hold_what_they_should() -> None:
    model = build_model(get_preset("tiny"), seed=0)
    client, server = split.split_model(model, 1)
    assert len(client.blocks) == 1 and len(server.blocks) == 1
    ptrs = {server.lm_head.weight.data_ptr(), client.embed.weight.data_ptr(), model.lm_head.weight.data_ptr()}
    assert len(ptrs) == 3  # copies, no shared storage
    # the tied head is the client's to train: the server steps everything else
    assert len(split.server_params(server)) == len(list(server.parameters())) - 1
    with pytest.raises(ConfigError):
        split.split_model(model, 3)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(server(client(x)), model(x))


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_lora_starts_as_the_base_model_and_merges_back(preset: str) -> None:
    base = build_model(get_preset(preset), seed=0)
    model = build_model(get_preset(preset), seed=0)
    names = lora.attach_lora(model, rank=4, alpha=8)
    assert len(names) == (4 if preset == "tiny" else 7) * 2  # attention and MLP projections of both blocks
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(x), base(x))
    trainable = common.trainable(model)
    assert trainable and all(k.endswith((".lora_A", ".lora_B")) for k in trainable)
    assert set(lora.lora_state(model)) == set(trainable)
    with torch.no_grad():
        for p in trainable.values():
            p.normal_(std=0.05)
        adapted = model(x)
        merged = lora.merge_lora(model)
        torch.testing.assert_close(merged(x), adapted, rtol=1e-4, atol=1e-5)
    assert not any(isinstance(m, lora.LoRALinear) for m in merged.modules())


def test_fedavg_with_lora_trains_and_sends_only_adapters(corpus: Corpus) -> None:
    job = JobConfig(preset="tiny", batch_size=4, seq_len=32, lr=1e-2)
    global_model, client = (build_model(get_preset("tiny"), seed=0) for _ in range(2))
    for m in (global_model, client):
        lora.attach_lora(m, rank=4, seed=7)
    frozen = {k: v.detach().clone() for k, v in client.named_parameters() if not v.requires_grad}
    server = fedavg.FedAvgServer(common.trainable(global_model), fedavg.FedAvgConfig(local_steps=3))
    opt = common.make_adamw(client.parameters(), job)
    up = fedavg.client_update(
        client,
        opt,
        server.global_state(),
        (common.shard_batch(corpus, job, 1, e) for e in range(3)),
        3,
        job.grad_clip,
    )
    assert set(up.delta) == set(lora.lora_state(client)) and up.losses[-1] < up.losses[0]
    adapter_numel = sum(t.numel() for t in up.delta.values())
    assert adapter_numel < 0.2 * sum(p.numel() for p in client.parameters())
    for k, v in client.named_parameters():
        if not v.requires_grad:
            assert torch.equal(v, frozen[k]), k  # the base never moves
    server.submit("c", 0, up.delta, up.samples)
    server.close_round()
    for k, v in lora.lora_state(global_model).items():
        torch.testing.assert_close(v, lora.lora_state(client)[k])
