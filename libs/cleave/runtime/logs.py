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
