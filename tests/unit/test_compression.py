"""Compressors: round trips, error bounds, top-k with error feedback, wire sizes and malformed input."""

from __future__ import annotations

import math

import pytest
import torch

from cleave import codec
from cleave.compression import (
    Cast,
    ErrorFeedback,
    Int8Blockwise,
    NoCompression,
    Packed,
    PackedTensors,
    TopK,
    decompress,
    get_compressor,
    raw_bytes,
    unpack,
    wire_bytes,
)
from cleave.errors import ConfigError, WireError


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "t", [randn(5, 7), torch.arange(10), randn(3).to(torch.bfloat16), torch.tensor(2.5), randn(0, 4)]
)
def test_none_round_trips_exactly(t: torch.Tensor) -> None:
    back = decompress(NoCompression().compress(t))
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_casts_meet_their_relative_error_bounds() -> None:
    t = randn(4096) * 10
    for spec, bound in (("bf16", 2**-8), ("fp16", 2**-11)):
        p = get_compressor(spec).compress(t)
        back = decompress(p)
        assert back.dtype == torch.float32 and p.payload_bytes == 2 * t.numel()
        assert float(((back - t).abs() / t.abs()).max()) <= bound


def test_fp16_saturates_instead_of_overflowing() -> None:
    back = decompress(Cast("fp16").compress(torch.tensor([1e6, -1e6, 1.0])))
    assert back.tolist() == [65504.0, -65504.0, 1.0]


@pytest.mark.parametrize("block", [256, 64, 7])
def test_int8_error_is_within_half_a_step_of_its_block(block: int) -> None:
    t = randn(1000) * torch.linspace(0.01, 100, 1000)  # magnitudes vary across blocks
    t[:block] = 0  # an all-zero block
    p = Int8Blockwise(block).compress(t.view(10, 100))
    back = decompress(p).view(-1)
    nb = math.ceil(t.numel() / block)
    assert p.payload_bytes == t.numel() + 4 * nb
    err = (back - t).abs()
    for b in range(nb):
        blk = slice(b * block, (b + 1) * block)
        assert float(err[blk].max()) <= float(t[blk].abs().max()) / 254 * (1 + 1e-6) + 1e-12
    assert torch.equal(back[:block], torch.zeros(block))


def test_topk_keeps_exactly_k_largest() -> None:
    t = randn(50, 20)
    tk = TopK(0.05)
    p = tk.compress(t)
    back = decompress(p)
    k = tk.k(t.numel())
    assert k == 50 and int((back != 0).sum()) == k
    kept = back.reshape(-1) != 0
    assert float(t.reshape(-1)[~kept].abs().max()) <= float(t.reshape(-1)[kept].abs().min())
    assert torch.equal(back.reshape(-1)[kept], t.reshape(-1)[kept])
    assert TopK(1e-9).k(10) == 1 and TopK(1.0).k(10) == 10 and TopK(0.5).k(0) == 0


@pytest.mark.parametrize("spec", ["topk:0.1", "int8:16", "bf16"])
def test_error_feedback_sends_what_was_meant_over_rounds(spec: str) -> None:
    """sum(sent) + residual == sum(meant) every round, so the average sent converges to the average meant."""
    ef = ErrorFeedback(get_compressor(spec))
    meant, sent = torch.zeros(200), torch.zeros(200)
    rounds = 60
    for r in range(rounds):
        g = randn(200, seed=r) * 0.1 + torch.linspace(-1, 1, 200)
        meant += g
        sent += decompress(ef.compress("w", g))
        torch.testing.assert_close(sent + ef.residual["w"], meant, atol=1e-4, rtol=0)
    assert float(ef.residual["w"].abs().max()) < 10  # bounded (top-k 10%: about 1/fraction times max |g|)
    assert float((sent - meant).abs().max()) / rounds < 0.1  # so the average sent converges to the meant
    assert ef.raw_bytes == rounds * 800 and 0 < ef.payload_bytes < ef.raw_bytes


def test_topk_without_feedback_would_lose_the_small_entries() -> None:
    g = torch.linspace(0.1, 1, 100)
    ef, tk = ErrorFeedback(TopK(0.1)), TopK(0.1)
    with_ef = sum(decompress(ef.compress("g", g)) for _ in range(60))  # 0.1 waits ~55 rounds for its turn
    without = sum(decompress(tk.compress(g)) for _ in range(60))
    assert int((without == 0).sum()) == 90  # the same 10 entries every round
    assert int((with_ef == 0).sum()) == 0  # every entry got through eventually


def test_packed_travels_through_the_codec_and_zstd_pays_only_for_topk() -> None:
    t = randn(250_000)
    msgs = {
        s: PackedTensors(tensors={"w": get_compressor(s).compress(t)}) for s in ("none", "int8", "topk:0.01")
    }
    for spec, msg in msgs.items():
        back = codec.decode(codec.encode(msg), PackedTensors)
        torch.testing.assert_close(unpack(back)["w"], unpack(msg)["w"], rtol=0, atol=0, msg=spec)
    none, topk = msgs["none"].tensors["w"], msgs["topk:0.01"].tensors["w"]
    assert wire_bytes(msgs["none"]) >= raw_bytes(t)  # random fp32: the codec does not compress it
    assert wire_bytes(msgs["topk:0.01"]) < topk.payload_bytes  # small index deltas do compress
    assert none.payload_bytes / topk.payload_bytes > 40


def test_get_compressor_parses_specs() -> None:
    assert get_compressor("none").spec == "none" and get_compressor("BF16").spec == "bf16"
    assert get_compressor("int8").spec == "int8:256" and get_compressor("int8:64").spec == "int8:64"
    assert get_compressor("topk:0.01").spec == "topk:0.01"
    for bad in ("zip", "topk", "topk:0", "topk:2", "int8:0", "int8:x", "bf16:3", ""):
        with pytest.raises(ConfigError):
            get_compressor(bad)


def test_non_float_tensors_pass_through_lossy_compressors() -> None:
    t = torch.arange(20)
    for spec in ("bf16", "int8", "topk:0.1"):
        assert torch.equal(decompress(ErrorFeedback(get_compressor(spec)).compress("i", t)), t)


def _tamper(p: Packed, **fields: object) -> Packed:
    return Packed.model_validate({**p.model_dump(), **fields})


def test_inconsistent_packed_tensors_are_rejected() -> None:
    t = randn(100)
    topk, int8 = TopK(0.1).compress(t), Int8Blockwise(16).compress(t)
    bad = [
        _tamper(topk, shape=(5,)),  # indices past the end
        # a repeated index (delta 0 after the first)
        _tamper(topk, indices=codec.tensor_to_data(torch.tensor([3, 0] + [1] * 8, dtype=torch.int32))),
        _tamper(topk, indices=None),
        _tamper(int8, scales=codec.tensor_to_data(torch.ones(2))),
        _tamper(int8, block=0),
        _tamper(NoCompression().compress(t), shape=(7, 7)),
        _tamper(NoCompression().compress(t), shape=(-1, -100)),
    ]
    for p in bad:
        with pytest.raises(WireError):
            decompress(p)
    with pytest.raises(WireError):
        codec.decode(codec.encode(PackedTensors(tensors={"w": topk}))[:-5], PackedTensors)


def test_topkq_round_trips_a_known_tensor_exactly_and_feedback_carries_the_remainder() -> None:
    """Kept magnitudes 1 and 3 are exactly the two 2-bit levels: those entries come back bit for bit, the
    rest is zero, and error feedback holds exactly what was not sent, for the next round."""
    x = torch.full((1000,), 1e-3)
    x[[3, 50, 400, 999]] = torch.tensor([1.0, -3.0, 3.0, -1.0])
    comp = get_compressor("topkq:0.004:2")  # k = 4
    p = comp.compress(x)
    kept = torch.where(x.abs() >= 1, x, torch.zeros(()))
    assert torch.equal(decompress(codec.decode(codec.encode(PackedTensors(tensors={"g": p})),
                                               PackedTensors).tensors["g"]), kept)
    ef = ErrorFeedback(comp)
    assert torch.equal(decompress(ef.compress("g", x)), kept)
    assert torch.equal(ef.residual["g"], x - kept)  # the 996 small entries wait for their turn
    nxt = decompress(ef.compress("g", torch.zeros(1000)))  # next round sends the four largest of the residual
    assert int((nxt != 0).sum()) == 4 and torch.allclose(nxt[nxt != 0], torch.full((4,), 1e-3))


def test_topkq_rounds_to_the_nearest_level_and_is_100x_smaller_on_the_wire() -> None:
    t = randn(1_000_000)
    comp = get_compressor("topkq:0.01")
    assert comp.spec == "topkq:0.01:2"
    back, kept = decompress(comp.compress(t)), TopK(0.01).compress(t)
    idx = torch.cumsum(codec.data_to_tensor(kept.indices).long(), 0)
    lo, hi = float(t[idx].abs().min()), float(t[idx].abs().max())
    mags = back[idx].abs()
    assert bool(((mags - lo).abs() < 1e-6).logical_or((mags - hi).abs() < 1e-6).all())  # two levels only
    assert float((back[idx] - t[idx]).abs().max()) <= (hi - lo) / 2 + 1e-6  # nearest of the two levels
    assert raw_bytes(t) / wire_bytes(PackedTensors(tensors={"t": comp.compress(t)})) >= 100


def test_topkq_bits_and_malformed_input() -> None:
    t = randn(4096)
    for bits in (1, 2, 4, 8):
        p = get_compressor(f"topkq:0.05:{bits}").compress(t)
        assert len(p.values.data) == math.ceil(205 * bits / 8) and decompress(p).shape == t.shape
    for bad in ("topkq", "topkq:0", "topkq:0.1:3", "topkq:0.1:x"):
        with pytest.raises(ConfigError):
            get_compressor(bad)
    p = get_compressor("topkq:0.05").compress(t)
    for broken in (p.model_copy(update={"block": 3}), p.model_copy(update={"scales": None}),
                   p.model_copy(update={"values": codec.tensor_to_data(torch.zeros(3, dtype=torch.uint8))})):
        with pytest.raises(WireError):
            decompress(broken)


def test_a_senders_huge_int8_block_costs_the_ps_no_memory() -> None:
    """An update of ~100 bytes claiming int8 blocks of 2**28 values made the PS pad its codes to one block: 2 GB
    and seconds for each such message (2**31: 16 GB). A block longer than the tensor is read as the tensor."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    t = randn(100)
    want = decompress(Int8Blockwise(128).compress(t))
    assert torch.equal(decompress(_tamper(Int8Blockwise(128).compress(t), block=1 << 28)), want)
    code = ("import torch\nfrom cleave.compression import Int8Blockwise, Packed, decompress\n"
            "from cleave.runtime.memory import resident\n"
            "p = Int8Blockwise(128).compress(torch.randn(100))\n"
            "p = Packed.model_validate({**p.model_dump(), 'block': 1 << 28})\n"
            "before = resident()[0]\n"
            "decompress(p)\n"
            "print(resident()[0] - before)\n")  # (VmHWM: a child's ru_maxrss starts at its parent's peak)
    grew = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              timeout=120).stdout)
    assert grew < 64 << 20, f"decoding grew the process by {grew >> 20} MiB"
