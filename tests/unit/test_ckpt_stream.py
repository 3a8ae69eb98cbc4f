"""The streamed checkpoint format: exact round trip, no copy of the model, every damaged chunk caught."""

from __future__ import annotations

import pytest
import torch

from cleave.errors import ConfigError, CorruptCheckpoint
from cleave.train.checkpoint import Decoder, Encoder, encode, restore, snapshot, targets
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer

CHUNK = 4096  # small, so that the tiny model's stream has many chunks


def trained(steps: int = 2) -> Trainer:
    t = Trainer(JobConfig(preset="tiny", batch_size=2, seq_len=16))
    for s in range(steps):
        t.step(s)
    return t


def test_round_trip_is_exact_and_keeps_the_stream_order() -> None:
    src, dst = trained(), trained(steps=1)  # dst: other weights and optimizer state
    data, m = encode(snapshot(src.model, src.opt, "j", 1, 1), CHUNK)
    assert m.size == len(data) and len(m.chunk_sha256) == -(-len(data) // CHUNK)
    restore(dst.model, dst.opt, data, m)
    want, got = src.model.state_dict(), dst.model.state_dict()
    assert all(torch.equal(want[k], got[k]) for k in want)
    a, b = src.opt.state_dict()["state"], dst.opt.state_dict()["state"]
    assert all(torch.equal(a[i][n], b[i][n]) for i in a for n in a[i])
    assert src.step(2) == dst.step(2)  # same weights, optimizer state and RNG: the same next step


def test_the_encoder_reads_the_live_tensors_in_place() -> None:
    src = trained(steps=0)
    enc = Encoder(snapshot(src.model, None, "j", 0, 1), CHUNK)
    first = bytearray(64)
    enc.readinto(first)
    w = next(iter(src.model.state_dict().values()))
    assert bytes(first) == w.reshape(-1).view(torch.uint8).numpy().tobytes()[:64]


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_a_damaged_stream_is_rejected_naming_why(damage: str) -> None:
    src, dst = trained(), trained(steps=0)
    data, m = encode(snapshot(src.model, src.opt, "j", 1, 1), CHUNK)
    if damage == "flip":
        bad = bytearray(data)
        bad[3 * CHUNK + 5] ^= 1
        data, why = bytes(bad), "chunk 3 of checkpoint step 1 does not match"
    elif damage == "truncate":
        data, why = data[: len(data) - 10], "truncated"
    else:
        data, why = data + b"x", "longer than its manifest"
    with pytest.raises(CorruptCheckpoint, match=why):
        restore(dst.model, dst.opt, data, m)


def test_pieces_of_any_size_decode_alike() -> None:
    src, dst = trained(), trained(steps=0)
    data, m = encode(snapshot(src.model, None, "j", 1, 1), CHUNK)
    dec = Decoder(m, targets(dst.model, None, m))
    for i in range(0, len(data), 1000):  # pieces that straddle tensors and chunks
        dec.write(data[i : i + 1000])
    dec.finish()
    assert all(torch.equal(v, dst.model.state_dict()[k]) for k, v in src.model.state_dict().items())


def test_a_checkpoint_of_another_model_is_refused_before_any_copy() -> None:
    src = trained(steps=0)
    other = Trainer(JobConfig(preset="tiny-llama", batch_size=2, seq_len=16))
    data, m = encode(snapshot(src.model, src.opt, "j", 0, 1), CHUNK)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ConfigError, match="does not fit this model"):
        restore(other.model, other.opt, data, m)
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())
