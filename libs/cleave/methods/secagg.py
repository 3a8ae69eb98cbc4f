"""Secure aggregation (Bonawitz et al. 2017, "Practical Secure Aggregation"): the PS learns the sum of a round's
updates and nothing about any one of them, and members may drop during the round. Pure: no NATS here.

Each round, with fresh keys (the PS only relays; `cleave_ps.jobs.secure` drives it over the bus):
1. keys: every member u makes two X25519 key pairs, c (to encrypt to the others) and s (to agree masks), and
   sends the public halves. U1 = the members whose keys came.
2. shares: u draws a 32-byte self-mask seed b_u and splits b_u and its private s key into Shamir shares,
   `threshold` of which recover each (over the prime field 2^521 - 1); it sends each other member v its two
   shares encrypted with AES-GCM under a key agreed from c_u and c_v, bound to the job, round and both ids.
   U2 = the members whose shares came; each gets the ciphertexts addressed to it.
3. masked input: u encodes its update in fixed point (`FIXED_POINT_BITS` fractional bits, two's complement
   mod 2^64) and sends y_u = x_u + PRG(b_u) + sum over v in U2 of ±PRG(s_uv) (+ when u < v, - when v < u), with
   s_uv agreed from s_u and s_v: the pair masks cancel in the sum. U3 = the members whose y came.
4. reveal: every member of U3 reveals, for each u of U3, its share of b_u, and for each u that dropped (U2
   minus U3), its share of u's private s key; never both for one member. With `threshold` reveals the PS
   recovers each b_u and each dropped member's s key, removes the self masks and the dropped members' pair
   masks, and is left with the sum of U3's updates. One survivor's y_u stays hidden by its pair masks with
   the other survivors (there must be at least two: `threshold` >= 2).

The PRG is ChaCha20's keystream; mask seeds come from HKDF-SHA256 over the X25519 secret. The PS sees the
public keys, ciphertexts it cannot open, masked inputs and the shares it needs; an honest-but-curious PS
learns the sum only. What it cannot do: check any one update (clipping happens on the member; robust rules
and staleness need the updates themselves and are refused with secagg), or stop a member from sending
garbage (which spoils the sum, as it would spoil a mean).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from cleave.errors import WireError

FIXED_POINT_BITS = 32  # fractional bits of the fixed-point encoding: 2^-32 ~ 2.3e-10 resolution, |x| < 2^31 / n
PRIME = (1 << 521) - 1  # Shamir's field: a Mersenne prime above any 32-byte secret
SHARE_BYTES = 66  # a field element, big-endian
KEY_BYTES = 32
NONCE_BYTES = 12  # AES-GCM
MIN_THRESHOLD = 2  # a single survivor's input would be the sum itself
Shapes = Mapping[str, tuple[int, ...]]


# ---------------------------------------------------------------- fixed point and masks


def encode(state: Mapping[str, torch.Tensor], bits: int = FIXED_POINT_BITS) -> dict[str, np.ndarray]:
    """Float tensors -> uint64 fixed point (two's complement): round(x * 2^bits) mod 2^64."""
    return {k: np.rint(t.detach().double().numpy() * float(1 << bits)).astype(np.int64).view(np.uint64)
            for k, t in state.items()}


def decode(fixed: Mapping[str, np.ndarray], bits: int = FIXED_POINT_BITS) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v.view(np.int64).astype(np.float64) / float(1 << bits)) for k, v in fixed.items()}


def prg(seed: bytes, shapes: Shapes) -> dict[str, np.ndarray]:
    """ChaCha20's keystream under `seed`, cut into uint64 arrays of `shapes` (in sorted name order)."""
    names = sorted(shapes)
    sizes = [int(np.prod(shapes[k], dtype=np.int64)) for k in names]
    stream = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor().update(bytes(8 * sum(sizes)))
    flat = np.frombuffer(stream, dtype=np.uint64)
    out, at = {}, 0
    for k, n in zip(names, sizes, strict=True):
        out[k] = flat[at : at + n].reshape(shapes[k])
        at += n
    return out


def _add(acc: dict[str, np.ndarray], x: Mapping[str, np.ndarray], sign: int = 1) -> None:
    for k, v in x.items():
        acc[k] = acc[k] + v if sign > 0 else acc[k] - v  # uint64: mod 2^64


def _kdf(secret: bytes, info: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info.encode()).derive(secret)


def _agree(private: X25519PrivateKey, public: bytes, info: str) -> bytes:
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError as e:
        raise WireError("bad_key", f"not an X25519 public key ({e})") from None
    return _kdf(shared, info)


def _pair_info(context: str, u: str, v: str, purpose: str) -> str:
    a, b = sorted((u, v))
    return f"cleave-secagg|{purpose}|{context}|{a}|{b}"


# ---------------------------------------------------------------- Shamir over GF(2^521 - 1)


def split_secret(secret: bytes, ids: Sequence[int], threshold: int) -> dict[int, int]:
    """Shares of `secret` for the points `ids` (nonzero, distinct); any `threshold` of them recover it."""
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = {}
    for x in ids:
        y = 0
        for c in reversed(coeffs):  # Horner
            y = (y * x + c) % PRIME
        out[x] = y
    return out


def recover_secret(shares: Mapping[int, int], threshold: int) -> bytes:
    """The secret from at least `threshold` shares; WireError when they are fewer or do not agree."""
    if len(shares) < threshold:
        raise WireError("too_few_shares", f"{len(shares)} shares, {threshold} needed")
    points = sorted(shares.items())

    def at(x0: int, pts: list[tuple[int, int]]) -> int:
        total = 0
        for i, (xi, yi) in enumerate(pts):
            num, den = 1, 1
            for j, (xj, _) in enumerate(pts):
                if i != j:
                    num = num * (x0 - xj) % PRIME
                    den = den * (xi - xj) % PRIME
            total = (total + yi * num * pow(den, PRIME - 2, PRIME)) % PRIME
        return total

    base = points[:threshold]
    if any(at(x, base) != y for x, y in points[threshold:]):  # every further share on the same polynomial
        raise WireError("bad_shares", "the revealed shares do not lie on one polynomial")
    secret = at(0, base)
    if secret >> (8 * KEY_BYTES):
        raise WireError("bad_shares", "the recovered secret is not 32 bytes")
    return secret.to_bytes(KEY_BYTES, "big")


def _share_bytes(y: int) -> bytes:
    return y.to_bytes(SHARE_BYTES, "big")


def _share_int(data: bytes) -> int:
    if len(data) != SHARE_BYTES or int.from_bytes(data, "big") >= PRIME:
        raise WireError("bad_share", f"a share is {SHARE_BYTES} bytes below the field's prime")
    return int.from_bytes(data, "big")


def point(members: Sequence[str], member: str) -> int:
    """A member's Shamir point: its place among the round's key holders, from 1."""
    return sorted(members).index(member) + 1


# ---------------------------------------------------------------- a member's side


@dataclass
class SecureMember:
    """One member's state for one round (`context` names the job, round and attempt: keys are never reused)."""

    me: str
    context: str
    c_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    s_key: X25519PrivateKey = field(default_factory=X25519PrivateKey.generate)
    b_seed: bytes = field(default_factory=lambda: os.urandom(KEY_BYTES))
    keys: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)  # U1: id -> (c public, s public)
    threshold: int = 0
    shares: dict[str, tuple[int, int]] = field(default_factory=dict)  # from u: (share of s key, share of b)
    u2: tuple[str, ...] = ()
    revealed: bool = False

    def public(self) -> tuple[bytes, bytes]:
        return self.c_key.public_key().public_bytes_raw(), self.s_key.public_key().public_bytes_raw()

    def share(self, keys: Mapping[str, tuple[bytes, bytes]], threshold: int) -> dict[str, bytes]:
        """Phase 2: the ciphertexts of this member's shares, one per other member of U1."""
        if self.me not in keys or keys[self.me] != self.public():
            raise WireError("not_in_round", f"{self.me}'s keys are not among the round's")
        if not MIN_THRESHOLD <= threshold <= len(keys):
            raise WireError("bad_threshold", f"threshold {threshold} for {len(keys)} members")
        self.keys, self.threshold = dict(keys), threshold
        ids = {v: point(list(keys), v) for v in keys}
        s_shares = split_secret(self.s_key.private_bytes_raw(), list(ids.values()), threshold)
        b_shares = split_secret(self.b_seed, list(ids.values()), threshold)
        out = {}
        for v, x in ids.items():
            if v == self.me:
                self.shares[v] = (s_shares[x], b_shares[x])
                continue
            key = _agree(self.c_key, keys[v][0], _pair_info(self.context, self.me, v, "enc"))
            nonce = os.urandom(NONCE_BYTES)
            sealed = AESGCM(key).encrypt(nonce, _share_bytes(s_shares[x]) + _share_bytes(b_shares[x]),
                                         f"{self.context}|{self.me}|{v}".encode())
            out[v] = nonce + sealed
        return out

    def receive(self, ciphertexts: Mapping[str, bytes], u2: Sequence[str]) -> None:
        """Phase 3's input: the shares other members of U2 sent this member, opened and checked."""
        if self.me not in u2 or not set(u2) <= set(self.keys) or len(u2) < self.threshold:
            raise WireError("bad_members", f"U2 of {len(u2)} members is not within the round's keys")
        for u in u2:
            if u == self.me:
                continue
            data = ciphertexts.get(u, b"")
            key = _agree(self.c_key, self.keys[u][0], _pair_info(self.context, u, self.me, "enc"))
            try:
                plain = AESGCM(key).decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], f"{self.context}|{u}|{self.me}".encode())
            except (InvalidTag, ValueError):
                raise WireError("bad_ciphertext", f"the shares from {u} do not open") from None
            self.shares[u] = (_share_int(plain[:SHARE_BYTES]), _share_int(plain[SHARE_BYTES:]))
        self.u2 = tuple(sorted(u2))

    def mask(self, update: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Phase 3: y = x + PRG(b) + the pair masks with every other member of U2."""
        if not self.u2:
            raise WireError("no_members", "the round's members (U2) are not known yet")
        limit = 2.0 ** (63 - FIXED_POINT_BITS) / len(self.u2)  # the sum of the members' inputs fits 63 bits
        worst = max((t.detach().abs().max().item() for t in update.values() if t.numel()), default=0.0)
        if not worst < limit:  # (beyond it the sum would wrap silently; nan too)
            raise ValueError(f"an entry of this update is {worst:.3g}, beyond the {limit:.3g} that secure "
                             f"aggregation's fixed point sums for {len(self.u2)} members: clip updates (update_clip)")
        y = encode(update)
        shapes = {k: v.shape for k, v in y.items()}
        _add(y, prg(self.b_seed, shapes))
        for v in self.u2:
            if v != self.me:
                seed = _agree(self.s_key, self.keys[v][1], _pair_info(self.context, self.me, v, "mask"))
                _add(y, prg(seed, shapes), 1 if self.me < v else -1)
        return y

    def reveal(self, u3: Sequence[str], dropped: Sequence[str]) -> tuple[dict[str, bytes], dict[str, bytes]]:
        """Phase 4: shares of b for the survivors, of the s key for the dropped; once, never both for one."""
        u3s, drop = set(u3), set(dropped)
        if self.revealed or u3s & drop or not (u3s | drop) <= set(self.u2) or self.me not in u3s \
                or len(u3s) < self.threshold:
            raise WireError("bad_reveal", f"survivors {sorted(u3s)[:5]} and dropped {sorted(drop)[:5]} do not "
                                          "split this round's members")
        self.revealed = True
        return ({u: _share_bytes(self.shares[u][1]) for u in sorted(u3s)},
                {u: _share_bytes(self.shares[u][0]) for u in sorted(drop)})


# ---------------------------------------------------------------- the PS's side


def unmask(context: str, keys: Mapping[str, tuple[bytes, bytes]], threshold: int, masked: Mapping[str, Mapping[str, np.ndarray]],
           dropped: Sequence[str], reveals: Mapping[str, tuple[Mapping[str, bytes], Mapping[str, bytes]]]
           ) -> dict[str, torch.Tensor]:
    """The sum of the survivors' updates (float64) from their masked inputs (`masked`: survivor -> y) and the
    reveals (revealer -> (b shares by member, s-key shares by dropped member))."""
    survivors = sorted(masked)
    shapes = {k: v.shape for k, v in next(iter(masked.values())).items()}
    total = {k: np.zeros(s, dtype=np.uint64) for k, s in shapes.items()}
    for y in masked.values():
        if {k: v.shape for k, v in y.items()} != shapes:
            raise WireError("bad_masked", "masked inputs of different shapes")
        _add(total, y)
    points = {v: point(list(keys), v) for v in keys}

    def gathered(u: str, which: int) -> dict[int, int]:
        return {points[r]: _share_int(rev[which][u]) for r, rev in reveals.items() if u in rev[which]}

    for u in survivors:
        _add(total, prg(recover_secret(gathered(u, 0), threshold), shapes), -1)
    for d in dropped:
        s_key = X25519PrivateKey.from_private_bytes(recover_secret(gathered(d, 1), threshold))
        if s_key.public_key().public_bytes_raw() != keys[d][1]:
            raise WireError("bad_shares", f"the recovered key of {d} is not its published key")
        for u in survivors:  # the pair mask u added for d, which d's own input would have cancelled
            seed = _agree(s_key, keys[u][1], _pair_info(context, u, d, "mask"))
            _add(total, prg(seed, shapes), -1 if u < d else 1)
    return decode(total)


def digest(context: str) -> str:
    """A short name for a round's session (logs)."""
    return hashlib.sha256(context.encode()).hexdigest()[:12]
