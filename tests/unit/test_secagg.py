"""Secure aggregation's math (no network): the PS's unmasked sum is the plain sum within fixed-point rounding,
with members dropping after they shared their keys; what the PS holds never gives one member's update."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cleave.errors import WireError
from cleave.methods import secagg

SHAPES = {"a": (3, 5), "b": (7,)}


def updates(n: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": {k: torch.randn(s, generator=g) * 0.01 for k, s in SHAPES.items()} for i in range(n)}


def run_round(xs, threshold: int, drop_after_shares=(), drop_after_mask=()):
    ctx = "job|3|s1"
    members = {u: secagg.SecureMember(u, ctx) for u in xs}
    keys = {u: m.public() for u, m in members.items()}
    sealed = {u: m.share(keys, threshold) for u, m in members.items()}
    u2 = sorted(u for u in members if u not in drop_after_shares)
    for v in u2:
        members[v].receive({u: sealed[u][v] for u in u2 if u != v}, u2)
    masked = {u: members[u].mask(xs[u]) for u in u2 if u not in drop_after_mask}
    u3 = sorted(masked)
    dropped = sorted(set(u2) - set(u3))
    reveals = {v: members[v].reveal(u3, dropped) for v in u3}
    total = secagg.unmask(ctx, keys, threshold, masked, dropped, reveals)
    return total, masked, reveals, members, keys, u3


@pytest.mark.parametrize("drop", [(), ("w1",)])
def test_the_unmasked_sum_is_the_plain_sum_with_or_without_a_dropout(drop):
    xs = updates(4)
    total, masked, *_ , u3 = run_round(xs, threshold=3, drop_after_mask=drop)
    for k in SHAPES:
        want = sum(xs[u][k].double() for u in u3)
        torch.testing.assert_close(total[k], want, rtol=0, atol=4 * 2.0**-32)
    # a masked input is noise: nothing like its member's update
    y = secagg.decode(masked["w0"])["a"]
    assert (y - xs["w0"]["a"].double()).abs().min() > 1e3


def test_members_dropping_before_their_shares_arrive_are_left_out():
    xs = updates(4)
    total, *_, u3 = run_round(xs, threshold=2, drop_after_shares=("w3",), drop_after_mask=("w2",))
    assert u3 == ["w0", "w1"]
    torch.testing.assert_close(total["b"], xs["w0"]["b"].double() + xs["w1"]["b"].double(), rtol=0, atol=1e-9)


def test_what_the_ps_holds_does_not_give_one_members_update():
    """Even after removing a survivor's self mask (its b is revealed), its pair masks with the other
    survivors hide its update."""
    xs = updates(3)
    _, masked, reveals, members, keys, u3 = run_round(xs, threshold=2, drop_after_mask=("w2",))
    points = {v: secagg.point(list(keys), v) for v in keys}
    b0 = secagg.recover_secret({points[r]: int.from_bytes(rev[0]["w0"], "big") for r, rev in reveals.items()}, 2)
    assert b0 == members["w0"].b_seed
    y = dict(masked["w0"])
    secagg._add(y, secagg.prg(b0, {k: v.shape for k, v in y.items()}), -1)
    assert (secagg.decode(y)["a"] - xs["w0"]["a"].double()).abs().min() > 1e3
    assert all("w0" not in rev[1] for rev in reveals.values())  # w0's key shares are never revealed


def test_refusals():
    xs = updates(3)
    ctx = "c"
    members = {u: secagg.SecureMember(u, ctx) for u in xs}
    keys = {u: m.public() for u, m in members.items()}
    with pytest.raises(WireError, match="threshold"):
        members["w0"].share(keys, 1)  # a lone survivor's input would be the sum
    sealed = {u: m.share(keys, 2) for u, m in members.items()}
    tampered = bytearray(sealed["w1"]["w0"])
    tampered[-1] ^= 1
    with pytest.raises(WireError, match="do not open"):
        members["w0"].receive({"w1": bytes(tampered), "w2": sealed["w2"]["w0"]}, ["w0", "w1", "w2"])
    members["w1"].receive({u: sealed[u]["w1"] for u in ("w0", "w2")}, ["w0", "w1", "w2"])
    members["w1"].reveal(["w0", "w1"], ["w2"])
    with pytest.raises(WireError, match="bad_reveal"):  # a second reveal (e.g. w0 now "dropped") is refused
        members["w1"].reveal(["w1", "w2"], ["w0"])
    shares = secagg.split_secret(b"\x07" * 32, [1, 2, 3], 2)
    assert secagg.recover_secret({1: shares[1], 3: shares[3]}, 2) == b"\x07" * 32
    with pytest.raises(WireError, match="one polynomial"):
        secagg.recover_secret({1: shares[1], 2: shares[2], 3: shares[3] + 1}, 2)


def test_fixed_point_round_trip():
    x = {"a": torch.tensor([-1.5, 0.0, 3.25e-6, 1e3])}
    back = secagg.decode(secagg.encode(x))["a"]
    torch.testing.assert_close(back, x["a"].double(), rtol=0, atol=2.0**-32)
    assert secagg.encode(x)["a"].dtype == np.uint64


def test_an_update_beyond_the_fixed_points_range_is_refused_not_wrapped():
    """An entry of 2^31 / n or more wrapped the sum silently (the fixed point of n inputs holds 63 bits); nan too."""
    xs = updates(3)
    big = {u: dict(x) for u, x in xs.items()}
    big["w1"]["a"] = big["w1"]["a"].clone()
    big["w1"]["a"][0, 0] = 2.0**31 / 3
    with pytest.raises(ValueError, match="beyond the 7.16e\\+08 that secure aggregation's fixed point sums for 3"):
        run_round(big, threshold=2)
    big["w1"]["a"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="clip updates"):
        run_round(big, threshold=2)
    big["w1"]["a"][0, 0] = 2.0**31 / 3 * 0.999  # just inside: the sum is the plain sum
    total, *_ = run_round(big, threshold=2)
    plain = sum(x["a"].double() for x in big.values())
    torch.testing.assert_close(total["a"], plain, rtol=0, atol=1e-6)
