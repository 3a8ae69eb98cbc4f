"""One error hierarchy for everything Cleave raises on purpose."""


class CleaveError(Exception):
    """Base of every error Cleave raises deliberately."""


class ConfigError(CleaveError):
    """A setting or job description is invalid; the message names the knob to change."""


class WireError(CleaveError):
    """A message could not be decoded or failed validation; it is rejected, never used."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # short snake_case tag, used as a counter label


class TooLarge(WireError):
    def __init__(self, detail: str) -> None:
        super().__init__("too_large", detail)


class Conflict(CleaveError):
    """A compare-and-set lost: someone else wrote the key first."""


class StepSpoiled(CleaveError):
    """A step's result cannot be trusted (a worker was caught lying): it is redone, never applied."""


class StepAborted(CleaveError):
    """A training step could not finish (the job was stopped, or the PS lost its lease)."""
