"""structlog configured once per process: console lines locally, JSON lines under compose."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _Stderr:
    """Whatever `sys.stderr` is when a line is written, not when logging was configured (a caller that swaps
    it, as pytest's capture does, and closes the old one, would otherwise leave every later line failing)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(service: str, json: bool | None = None, level: str | None = None) -> structlog.BoundLogger:
    """Configure logging for this process and return a logger bound to `service`."""
    json = os.environ.get("CLEAVE_LOG_JSON", "0") == "1" if json is None else json
    level = (level or os.environ.get("CLEAVE_LOG_LEVEL", "info")).upper()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger(service)


def unless_configured(level: str = "error") -> None:
    """Where nothing configured logging (a program or a notebook calling `cleave.api`), Cleave's lines of `level`
    and above go to stderr: structlog's own default prints every line on stdout, into the program's output (a
    client's retries of a hub not up: a warning each). A program that configured structlog keeps its own."""
    if structlog.is_configured():
        return
    least = logging.getLevelName(level.upper())

    def at_least(_logger: object, method: str, event: dict) -> dict:
        if logging.getLevelName(method.upper()) < least:
            raise structlog.DropEvent
        return event

    structlog.configure(  # (filtered by a processor, not the wrapper: structlog's log capture still sees all)
        processors=[structlog.processors.add_log_level, at_least, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.dev.ConsoleRenderer(colors=False)],
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),
        cache_logger_on_first_use=False,
    )
