"""The Python API's arguments, checked as a job's settings are: each of its own type (no '2' for 2), in range and
finite; a wrong one raises pydantic's ValidationError naming it, before anything starts or connects."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Annotated, TypeVar

from pydantic import ConfigDict, Field, ValidationError, validate_call

from cleave.schemas.jobs import JOB_ID_PATTERN

JobId = Annotated[str, Field(pattern=JOB_ID_PATTERN)]
Seconds = Annotated[float, Field(gt=0)]  # a wait or a period: more than none
F = TypeVar("F", bound=Callable)
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
