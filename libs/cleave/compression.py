"""Lossy compressors for what the approximate methods send (pseudo-gradients, weight deltas, activations).

Every compressor turns a tensor into a `Packed` message (pydantic, tensors as `TensorData`) and back:

| spec          | what travels                                               | bytes / fp32 value | error bound        |
|---------------|------------------------------------------------------------|--------------------|--------------------|
| `none`        | the tensor as it is                                        | 4                  | exact              |
| `fp16`        | an IEEE half cast, saturated to +-65504                     | 2                  | rel. 2^-11 (normal)|
| `bf16`        | a bfloat16 cast (round to nearest even)                     | 2                  | rel. 2^-8          |
| `int8[:B]`    | int8 codes, one fp32 scale (absmax/127) per block of B      | 1 + 4/B            | abs. absmax_blk/254|
| `topk:F`      | the ceil(F*n) largest magnitudes: fp32 values + int32 index deltas | ~8F (less after zstd) | drops the rest |
| `topkq:F[:b]` | the same entries at b bits each (sign + 2^(b-1) magnitude levels), b in 1,2,4,8 (2) | ~F(4+b/8) raw, ~F(1.3+b/8) after zstd | drops the rest, rounds the kept |

Lossy compressors are meant to be used through `ErrorFeedback`, which keeps per tensor name the part of
what was meant to be sent that did not get through and adds it to the next round's tensor; what every
round sends then sums, over rounds, to what was meant (minus one bounded residual).

zstd is not applied here: `cleave.codec` owns zstandard and compresses a whole message only when a sample
of it shrinks (`codec.encode`). Casts and int8 codes barely compress; top-k index deltas (small integers
in int32) do, which is why indices travel as deltas of sorted positions. `wire_bytes` measures a message
exactly as the codec would send it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from cleave import codec
from cleave.errors import ConfigError, WireError
from cleave.schemas import MAX_TENSOR_ELEMENTS, Packed, PackedTensors, Wire

DEFAULT_INT8_BLOCK = 256  # values per fp32 scale: 1.6% overhead, and one outlier spoils only its block
INT8_LEVELS = 127  # symmetric codes -127..127 (-128 unused, so zero and negation are exact)
FP16_MAX = 65504.0
DEFAULT_TOPKQ_BITS = 2  # topkq: a sign and two magnitude levels per kept value  # largest finite half; larger magnitudes saturate instead of becoming inf


def raw_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def wire_bytes(msg: Wire) -> int:
    """The size of `msg` on the wire: the codec's own frame (msgpack, zstd where a sample shows it pays)."""
    return len(codec.encode(msg))


class Compressor(Protocol):
    spec: str
    lossless: bool

    def compress(self, t: torch.Tensor) -> Packed: ...

    def decompress(self, p: Packed) -> torch.Tensor: ...


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _check_shape(p: Packed) -> int:
    if len(p.shape) > 8 or any(d < 0 for d in p.shape) or p.numel > MAX_TENSOR_ELEMENTS:
        raise WireError("bad_packed", f"shape {p.shape}")
    return p.numel


def _restore(x: torch.Tensor, p: Packed) -> torch.Tensor:
    return x.to(getattr(torch, p.dtype)).reshape(p.shape)


def _plain(t: torch.Tensor) -> Packed:
    return Packed(kind="none", dtype=_dtype_name(t), shape=tuple(t.shape), values=codec.tensor_to_data(t))


@dataclass(frozen=True)
class NoCompression:
    spec: str = "none"
    lossless: bool = True

    def compress(self, t: torch.Tensor) -> Packed:
        return _plain(t)

    def decompress(self, p: Packed) -> torch.Tensor:
        _check_shape(p)
        v = codec.data_to_tensor(p.values)
        if v.numel() != p.numel:
            raise WireError("bad_packed", f"{v.numel()} values for shape {p.shape}")
        return _restore(v, p)


@dataclass(frozen=True)
class Cast:
    """fp16 or bf16: half the bytes of fp32, round to nearest (fp16 saturates at its largest finite)."""

    spec: Literal["fp16", "bf16"]
    lossless: bool = False

    def compress(self, t: torch.Tensor) -> Packed:
        if not t.is_floating_point():
            return _plain(t)
        x = t.detach()
        x = x.clamp(-FP16_MAX, FP16_MAX).half() if self.spec == "fp16" else x.to(torch.bfloat16)
        return Packed(
            kind=self.spec, dtype=_dtype_name(t), shape=tuple(t.shape), values=codec.tensor_to_data(x)
        )

    def decompress(self, p: Packed) -> torch.Tensor:
        return NoCompression().decompress(p)


@dataclass(frozen=True)
class Int8Blockwise:
    """Symmetric int8 with one scale per `block` consecutive values (flattened): q = round(x / s),
    s = absmax(block) / 127, round half to even. Error per value <= s / 2 = absmax(block) / 254."""

    block: int = DEFAULT_INT8_BLOCK
    lossless: bool = False

    @property
    def spec(self) -> str:
        return f"int8:{self.block}"

    def compress(self, t: torch.Tensor) -> Packed:
        if not t.is_floating_point():
            return _plain(t)
        x = t.detach().reshape(-1).float()
        n, nb = x.numel(), -(-x.numel() // self.block)
        padded = torch.nn.functional.pad(x, (0, nb * self.block - n)).view(nb, self.block)  # (blocks, B)
        scale = padded.abs().amax(dim=1) / INT8_LEVELS  # (blocks,)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale works
        q = torch.round(padded / scale[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
        return Packed(
            kind="int8",
            dtype=_dtype_name(t),
            shape=tuple(t.shape),
            block=self.block,
            values=codec.tensor_to_data(q.view(-1)[:n]),
            scales=codec.tensor_to_data(scale),
        )

    def decompress(self, p: Packed) -> torch.Tensor:
        n = _check_shape(p)
        if p.scales is None or p.block <= 0 or p.values.dtype != "int8" or p.scales.dtype != "float32":
            raise WireError("bad_packed", "int8 needs int8 codes, float32 scales and a positive block")
        q, scale = codec.data_to_tensor(p.values).reshape(-1), codec.data_to_tensor(p.scales).reshape(-1)
        nb = -(-n // p.block)
        if q.numel() != n or scale.numel() != nb:
            raise WireError("bad_packed", f"{q.numel()} codes, {scale.numel()} scales for {n} values")
        if nb == 1:  # (a block as long as the tensor, or longer: none padded to it: a sender's block of 2**31
            return _restore(q.float() * scale[0], p)  # made the PS allocate 16 GB for an update of 100 bytes)
        q = torch.nn.functional.pad(q.float(), (0, nb * p.block - n)).view(nb, p.block)  # (blocks, B); B < n
        return _restore((q * scale[:, None]).view(-1)[:n], p)


@dataclass(frozen=True)
class TopK:
    """Keeps the k = ceil(fraction * n) entries of largest magnitude (at least one of a non-empty tensor);
    the rest are dropped here and carried forward by `ErrorFeedback`."""

    fraction: float
    lossless: bool = False

    @property
    def spec(self) -> str:
        return f"topk:{self.fraction:g}"

    def k(self, n: int) -> int:
        return 0 if n == 0 else min(n, max(1, math.ceil(self.fraction * n)))

    def compress(self, t: torch.Tensor) -> Packed:
        if not t.is_floating_point():
            return _plain(t)
        x = t.detach().reshape(-1)
        idx = torch.topk(x.abs(), self.k(x.numel()), sorted=False).indices.sort().values
        deltas = torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32)  # small gaps: zstd shrinks them
        return Packed(
            kind="topk",
            dtype=_dtype_name(t),
            shape=tuple(t.shape),
            values=codec.tensor_to_data(x[idx].float()),
            indices=codec.tensor_to_data(deltas),
        )

    def decompress(self, p: Packed) -> torch.Tensor:
        n = _check_shape(p)
        if p.indices is None or p.indices.dtype != "int32":
            raise WireError("bad_packed", "topk needs int32 index deltas")
        v = codec.data_to_tensor(p.values).reshape(-1).float()
        d = codec.data_to_tensor(p.indices).reshape(-1)
        if d.numel() != v.numel() or v.numel() > n or (d.numel() and (d[0] < 0 or bool((d[1:] < 1).any()))):
            raise WireError("bad_packed", "topk needs one index delta per value, positive after the first")
        idx = torch.cumsum(d.long(), 0)
        if idx.numel() and idx[-1] >= n:
            raise WireError("bad_packed", f"topk index {int(idx[-1])} out of range for {n} values")
        out = torch.zeros(n, dtype=torch.float32)
        out[idx] = v
        return _restore(out, p)


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` bits each (bits divides 8), packed little end first into bytes."""
    per = 8 // bits
    c = torch.nn.functional.pad(codes.to(torch.int32), (0, -codes.numel() % per)).view(-1, per)  # (bytes, per)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (c << shifts).sum(dim=1).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return ((packed.to(torch.int32)[:, None] >> shifts) & mask).view(-1)[:n]  # (bytes * per,) -> (n,)


@dataclass(frozen=True)
class TopKQuantized:
    """Top-k with the kept values at `bits` bits each: one sign bit and 2^(bits-1) magnitude levels evenly
    spaced between the smallest and largest kept magnitude (one level, at bits = 1: their mean), rounded to
    the nearest level. With `ErrorFeedback` both what is dropped and what is rounded off wait in the residual.
    At F = 0.01 and 2 bits a pseudo-gradient travels in about 1/100 of its fp32 bytes or less."""

    fraction: float
    bits: int = 2
    lossless: bool = False

    @property
    def spec(self) -> str:
        return f"topkq:{self.fraction:g}:{self.bits}"

    def compress(self, t: torch.Tensor) -> Packed:
        if not t.is_floating_point():
            return _plain(t)
        x = t.detach().reshape(-1).float()
        idx = torch.topk(x.abs(), TopK(self.fraction).k(x.numel()), sorted=False).indices.sort().values
        v = x[idx]
        mag, levels = v.abs(), 1 << (self.bits - 1)
        lo, hi = (mag.min(), mag.max()) if mag.numel() else (x.new_zeros(()), x.new_zeros(()))
        if levels == 1:
            lo = hi = mag.mean() if mag.numel() else lo
        step = (hi - lo) / (levels - 1) if levels > 1 and hi > lo else None
        q = torch.zeros_like(mag, dtype=torch.int32) if step is None else torch.round((mag - lo) / step).int()
        codes = ((v < 0).int() << (self.bits - 1)) | q.clamp_(0, levels - 1)
        return Packed(
            kind="topkq", dtype=_dtype_name(t), shape=tuple(t.shape), block=self.bits,
            values=codec.tensor_to_data(_pack_bits(codes, self.bits)),
            scales=codec.tensor_to_data(torch.stack([lo, hi]).float()),
            indices=codec.tensor_to_data(torch.diff(idx, prepend=idx.new_zeros(1)).to(torch.int32)),
        )

    def decompress(self, p: Packed) -> torch.Tensor:
        _check_shape(p)
        if p.block not in (1, 2, 4, 8) or p.values.dtype != "uint8" or p.scales is None or p.indices is None:
            raise WireError("bad_packed", "topkq needs 1, 2, 4 or 8 bits, uint8 codes, scales and indices")
        scales = codec.data_to_tensor(p.scales).reshape(-1).float()
        packed = codec.data_to_tensor(p.values).reshape(-1)
        d = codec.data_to_tensor(p.indices).reshape(-1)
        k = d.numel()
        if scales.numel() != 2 or packed.numel() != -(-k * p.block // 8):
            raise WireError("bad_packed", f"topkq: {packed.numel()} code bytes, {scales.numel()} scales for {k}")
        codes = _unpack_bits(packed, p.block, k)
        levels = 1 << (p.block - 1)
        step = (scales[1] - scales[0]) / (levels - 1) if levels > 1 else 0.0
        mag = scales[0] + (codes & (levels - 1)).float() * step
        v = torch.where((codes >> (p.block - 1)).bool(), -mag, mag)
        dense = TopK(1.0).decompress(p.model_copy(update={
            "kind": "topk", "dtype": "float32", "values": codec.tensor_to_data(v)}))
        return _restore(dense.reshape(-1), p)


def get_compressor(spec: str) -> Compressor:
    """'none', 'fp16', 'bf16', 'int8' or 'int8:BLOCK', 'topk:FRACTION' (0 < FRACTION <= 1),
    'topkq:FRACTION[:BITS]' (BITS 1, 2, 4 or 8; default 2)."""
    name, _, arg = spec.strip().lower().partition(":")
    try:
        if name == "none" and not arg:
            return NoCompression()
        if name in ("fp16", "bf16") and not arg:
            return Cast(name)  # type: ignore[arg-type]
        if name == "int8":
            block = int(arg) if arg else DEFAULT_INT8_BLOCK
            if block > 0:
                return Int8Blockwise(block)
        if name == "topk" and arg:
            fraction = float(arg)
            if 0 < fraction <= 1:
                return TopK(fraction)
        if name == "topkq" and arg:
            frac, _, bits = arg.partition(":")
            fraction, nbits = float(frac), int(bits) if bits else DEFAULT_TOPKQ_BITS
            if 0 < fraction <= 1 and nbits in (1, 2, 4, 8):
                return TopKQuantized(fraction, nbits)
    except ValueError:
        pass
    raise ConfigError(
        f"compression={spec!r} is not one of none, fp16, bf16, int8[:BLOCK], topk:FRACTION (0<F<=1), "
        "topkq:FRACTION[:BITS] (BITS 1, 2, 4 or 8)"
    )


@dataclass
class ErrorFeedback:
    """A sender's compressor with memory: per tensor name, what earlier rounds failed to send is added
    to this round's tensor before compressing (Seide et al. 2014; Karimireddy et al. 2019, EF-SGD).

    One per sender (worker) and stream; the residual is local state, never sent. Lossless compressors
    keep no residual.
    """

    compressor: Compressor
    residual: dict[str, torch.Tensor] = field(default_factory=dict)
    raw_bytes: int = 0  # what the uncompressed tensors would have carried
    payload_bytes: int = 0  # tensor bytes actually packed (before msgpack/zstd)

    def compress(self, name: str, t: torch.Tensor) -> Packed:
        target = t.detach()
        if not self.compressor.lossless and t.is_floating_point():
            prev = self.residual.get(name)
            target = target.float() + prev if prev is not None else target.float()
        p = self.compressor.compress(target)
        if not self.compressor.lossless and t.is_floating_point():
            self.residual[name] = target - self.compressor.decompress(p).float()
        self.raw_bytes += raw_bytes(t)
        self.payload_bytes += p.payload_bytes
        return p

    def pack(self, tensors: dict[str, torch.Tensor]) -> PackedTensors:
        return PackedTensors(tensors={k: self.compress(k, v) for k, v in tensors.items()})

    def reset(self) -> None:
        self.residual.clear()


def unpack(msg: PackedTensors) -> dict[str, torch.Tensor]:
    """Decompress every tensor of a message (any compressor: the kind travels with each tensor)."""
    return {k: decompress(p) for k, p in msg.tensors.items()}


_DECODERS: dict[str, Compressor] = {
    "none": NoCompression(),
    "fp16": Cast("fp16"),
    "bf16": Cast("bf16"),
    "int8": Int8Blockwise(),
    "topk": TopK(1.0),
    "topkq": TopKQuantized(1.0),
}


def decompress(p: Packed) -> torch.Tensor:
    """Any `Packed` back to a dense tensor of its original dtype and shape; WireError if inconsistent."""
    return _DECODERS[p.kind].decompress(p)
