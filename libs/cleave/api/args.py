"""The Python API's arguments, checked as a job's settings are: each of its own type (no '2' for 2), in range and
finite; a wrong one raises pydantic's ValidationError naming it, before anything starts or connects. And its
calls' NATS work, run to its end from synchronous code wherever that runs (`blocking`)."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, TypeVar

from pydantic import ConfigDict, Field, ValidationError, validate_call

from cleave.schemas.jobs import JOB_ID_PATTERN

# an export's precision, named as a job's (fp32, bf16, fp16), or by the wire's names, as they once were
EXPORT_PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float32": "float32",
                     "bfloat16": "bfloat16", "float16": "float16"}

JobId = Annotated[str, Field(pattern=JOB_ID_PATTERN)]
Seconds = Annotated[float, Field(gt=0)]  # a wait or a period: more than none
F = TypeVar("F", bound=Callable)
R = TypeVar("R")
CONFIG = ConfigDict(strict=True, allow_inf_nan=False, arbitrary_types_allowed=True)


def checked(fn: F) -> F:
    """`fn` with its arguments validated against its annotations; an error names the argument even where it was
    given by position (pydantic's own says `0`)."""
    validated = validate_call(config=CONFIG)(fn)
    names = list(inspect.signature(fn).parameters)

    def named(loc: tuple) -> tuple:
        return (names[loc[0]], *loc[1:]) if loc and isinstance(loc[0], int) and loc[0] < len(names) else loc

    @functools.wraps(fn)
    def call(*args, **kwargs):  # noqa: ANN202 - whatever fn returns
        try:
            return validated(*args, **kwargs)
        except ValidationError as e:
            details = [{"type": d["type"], "loc": named(d["loc"]), "input": d["input"], "ctx": d.get("ctx", {})}
                       for d in e.errors()]
            raise ValidationError.from_exception_data(e.title, details) from None

    return call  # type: ignore[return-value]


def blocking(coro: Coroutine[Any, Any, R]) -> R:
    """`asyncio.run(coro)`, also from a thread that already runs an event loop (a Jupyter notebook's cells run in
    its kernel's, where asyncio.run raises RuntimeError): there in a thread of its own, this one waiting for it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1, thread_name_prefix="cleave-api") as pool:
        return pool.submit(asyncio.run, coro).result()
