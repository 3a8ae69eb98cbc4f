"""The one table of tensor element types on the wire: names and sizes (the codec maps them to torch and numpy)."""

from __future__ import annotations

DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8")
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1}
COMPUTE_DTYPE_BYTES = 4  # a worker computes every tile in float32: what an element takes in its memory
