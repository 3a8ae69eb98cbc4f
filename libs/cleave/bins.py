"""A msgpack body unpacked with its large bin values left where they are: views of the body, not copies.

msgpack copies every bin value it unpacks into a `bytes` of its own: a 4 MiB result block is copied once more
after the kernel put it in the message's buffer. `unpack` first walks the body's structure (each value's type
and length, nothing decoded) to find the bin values of `min_bytes` or more, unpacks the body with each of them
replaced by a random 16-byte stand-in (msgpack itself decoding and checking everything else), and puts a
read-only view of the body's bytes where each stand-in came back. A stand-in is random for each call, so no
sender can forge one. A body the walk cannot follow (malformed, or more than `MAX_WALKED` values before its
end) is unpacked whole by msgpack, which then copies or says what is wrong with it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable

MAX_WALKED = 4096  # values walked in Python before the body is left to msgpack whole (a tile's message: ~30)
_STAND_IN = struct.Struct("<12sI")  # a random tag and the value's index: 16 bytes, in msgpack's bin 8
_U8, _U16, _U32 = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I")

# the first byte's code -> (bytes of the head, what follows: "n" a length of data in the head's last field,
# "a" an array of that many values, "m" a map of that many pairs, or a fixed count of data bytes)
_HEADS: dict[int, tuple[int, str | int]] = {
    0xC0: (1, 0), 0xC2: (1, 0), 0xC3: (1, 0),  # nil, false, true
    0xC4: (2, "n"), 0xC5: (3, "n"), 0xC6: (5, "n"),  # bin 8, 16, 32
    0xC7: (3, "n"), 0xC8: (4, "n"), 0xC9: (6, "n"),  # ext 8, 16, 32 (length, then the type byte)
    0xCA: (1, 4), 0xCB: (1, 8),  # float 32, 64
    0xCC: (1, 1), 0xCD: (1, 2), 0xCE: (1, 4), 0xCF: (1, 8),  # uint 8-64
    0xD0: (1, 1), 0xD1: (1, 2), 0xD2: (1, 4), 0xD3: (1, 8),  # int 8-64
    0xD4: (2, 1), 0xD5: (2, 2), 0xD6: (2, 4), 0xD7: (2, 8), 0xD8: (2, 16),  # fixext 1-16
    0xD9: (2, "n"), 0xDA: (3, "n"), 0xDB: (5, "n"),  # str 8, 16, 32
    0xDC: (3, "a"), 0xDD: (5, "a"), 0xDE: (3, "m"), 0xDF: (5, "m"),  # array 16, 32; map 16, 32
}
_SIZES = {0xC4: 1, 0xC7: 1, 0xD9: 1, 0xC5: 2, 0xC8: 2, 0xDA: 2, 0xDC: 2, 0xDE: 2}  # else 4 bytes
_BINS = (0xC4, 0xC5, 0xC6)


def _length(body: memoryview, at: int, code: int) -> int:
    """The length in the head at `at` (right after its code byte)."""
    size = _SIZES.get(code, 4)
    if at + 1 + size > len(body):
        raise IndexError
    return (_U8 if size == 1 else _U16 if size == 2 else _U32).unpack_from(body, at + 1)[0]


def find(body: memoryview, min_bytes: int) -> list[tuple[int, int, int]] | None:
    """(head, start, end) of each bin value of `min_bytes` or more in `body`, in order: where its msgpack head
    begins and its data begins and ends; None where the walk cannot follow the body to exactly its end within
    MAX_WALKED values."""
    found, at, left, walked = [], 0, 1, 0  # left: values still to walk
    try:
        while left:
            left -= 1
            walked += 1
            if walked > MAX_WALKED:
                return None
            code = body[at]
            if code <= 0x7F or code >= 0xE0:  # fixint
                at += 1
            elif code <= 0x8F:  # fixmap
                left += 2 * (code & 0x0F)
                at += 1
            elif code <= 0x9F:  # fixarray
                left += code & 0x0F
                at += 1
            elif code <= 0xBF:  # fixstr
                at += 1 + (code & 0x1F)
            else:
                head, then = _HEADS[code]  # (0xC1, never used: KeyError)
                if then == "n":
                    n = _length(body, at, code)
                    if code in _BINS and n >= min_bytes:
                        found.append((at, at + head, at + head + n))
                    at += head + n
                elif then in ("a", "m"):
                    left += _length(body, at, code) * (2 if then == "m" else 1)
                    at += head
                else:
                    at += head + then
            if at > len(body):
                return None
    except (IndexError, KeyError):
        return None
    return found if at == len(body) else None


def unpack(body: memoryview, min_bytes: int, unpackb: Callable[[bytes], object]) -> object:
    """`unpackb(body)`, each bin value of `min_bytes` or more a read-only view of `body` instead of a copy."""
    spans = find(body, min_bytes)
    if not spans:
        return unpackb(body)
    tag, parts, at = os.urandom(12), [], 0
    for i, (head, _, end) in enumerate(spans):
        parts += [body[at:head], b"\xc4\x10", _STAND_IN.pack(tag, i)]
        at = end
    parts.append(body[at:])
    views = [body[start:end].toreadonly() for _, start, end in spans]
    return _put_back(unpackb(b"".join(parts)), tag, views)


def _put_back(obj: object, tag: bytes, views: list[memoryview]) -> object:
    if isinstance(obj, dict):
        return {k: _put_back(v, tag, views) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_put_back(v, tag, views) for v in obj]
    if isinstance(obj, bytes) and len(obj) == _STAND_IN.size and obj[:12] == tag:
        return views[_STAND_IN.unpack(obj)[1]]
    return obj
