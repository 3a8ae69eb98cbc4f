"""The base of every message (frozen, unknown fields ignored) and the tensors inside messages."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, model_validator

from cleave.errors import CleaveError
from cleave.schemas.dtypes import DTYPE_SIZES, DTYPES
from cleave.schemas.limits import MAX_TENSOR_ELEMENTS

COMPRESSION_KINDS = ("none", "fp16", "bf16", "int8", "topk", "topkq")  # what a Packed tensor may be (cleave.compression)

def checked_str(check: Callable[[str], object]) -> Any:  # noqa: ANN401 - an Annotated type
    """A str field's type whose value `check` accepts: what `check` raises (a CleaveError naming the mistake)
    becomes the field's validation error, so a setting or message names it like any other."""

    def validate(value: str) -> str:
        try:
            check(value)
        except CleaveError as e:
            raise ValueError(str(e)) from None
        return value

    return Annotated[str, AfterValidator(validate)]


class Wire(BaseModel):
    """Base of all messages: immutable, and open-world (fields a newer peer adds are ignored)."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class TensorData(Wire):
    """A dense tensor: dtype name, shape and raw little-endian bytes (bf16 travels as its bits)."""

    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: tuple[int, ...] = Field(max_length=8)
    # bytes as received; a sender may build it over a tensor's own memory (`codec.tensor_view`), which is
    # packed as it is, without a copy
    data: Annotated[bytes, PlainSerializer(lambda v: v)]

    @model_validator(mode="after")
    def _size_matches(self) -> TensorData:
        if any(d < 0 or d > MAX_TENSOR_ELEMENTS for d in self.shape):
            raise ValueError(f"dimension out of range in shape {self.shape}")
        n = math.prod(self.shape)
        if n > MAX_TENSOR_ELEMENTS:
            raise ValueError(f"shape {self.shape} declares {n} elements, over the limit {MAX_TENSOR_ELEMENTS}")
        if n * DTYPE_SIZES[self.dtype] != len(self.data):
            raise ValueError(f"shape {self.shape} of {self.dtype} needs {n * DTYPE_SIZES[self.dtype]} bytes, got {len(self.data)}")
        return self


class Packed(Wire):
    """One compressed tensor: what the codec sends in place of a `TensorData`."""

    kind: Literal[COMPRESSION_KINDS]  # type: ignore[valid-type]
    dtype: Literal[DTYPES]  # type: ignore[valid-type]  # the original dtype, restored on decompression
    shape: tuple[int, ...] = Field((), max_length=8)
    values: TensorData  # the cast tensor, the int8 codes, or the kept top-k values
    scales: TensorData | None = None  # int8: one float32 scale per block; topkq: the lowest and highest magnitude
    indices: TensorData | None = None  # topk, topkq: int32 deltas of the sorted flat positions of `values`
    block: int = 0  # int8: values per scale; topkq: bits per kept value (packed into uint8 `values`)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data carried (before the codec's msgpack framing and optional zstd)."""
        return sum(len(t.data) for t in (self.values, self.scales, self.indices) if t is not None)


class PackedTensors(Wire):
    """A named set of compressed tensors (a pseudo-gradient, a weight delta, LoRA adapters)."""

    tensors: dict[str, Packed]
