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


class _ErrorsOnStderr:
    """Cleave's logger in a program that configured no logging: its errors on stderr, its other lines dropped."""

    def _write(self, message: str) -> None:
        _Stderr().write(message + "\n")

    def _drop(self, message: str) -> None:
        pass

    error = err = exception = critical = fatal = failure = _write
    msg = log = debug = info = warning = warn = _drop


def _by_name(*args: object) -> object:
    """Cleave's loggers (`cleave.*`) write errors only, to stderr; any other keeps structlog's default (stdout)."""
    name = args[0] if args else None
    if isinstance(name, str) and name.split(".")[0] == "cleave":
        return _ErrorsOnStderr()
    return structlog.PrintLogger()


def unless_configured() -> None:
    """Where nothing configured logging (a program or a notebook calling `cleave.api`), Cleave's own lines are
    errors only, on stderr: structlog's default prints every line on stdout, into the program's output (a
    client's retries of a hub not up: a warning each). The program's own structlog lines stay as structlog's
    defaults have them, and a program that configured structlog keeps its configuration."""
    if structlog.is_configured():
        return
    structlog.configure(logger_factory=_by_name, cache_logger_on_first_use=False)
