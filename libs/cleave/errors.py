"""Every error Cleave raises on purpose, and every exit status a Cleave process ends with.

An error that ends a process names the status it ends with (`exit_code`); the supervisors read the status
to decide whether to start the process again. One tree: everything below derives from `CleaveError`, except
`Stopped`, which is a request to stop (like KeyboardInterrupt), not an error.
"""

from __future__ import annotations

import signal

# ---- exit statuses -----------------------------------------------------------------------------------
EXIT_OK = 0  # done, or stopped on request
EXIT_ERROR = 2  # a CleaveError: a setting, a job description or an input is wrong; the message says which
EXIT_FENCED = 3  # a PS whose job another PS took over: the supervisor does not restart it
EXIT_JOB_FAILED = 4  # a job that cannot go on (e.g. split learning lost its client): not restarted either
EXIT_GROUP_LOST = 5  # a PS replica of the group is gone: restart and re-form from the last commit
EXIT_INTERRUPTED = 130  # a second Ctrl-C: out at once, nothing drained
# a PS ending with these stays down (one that refused its job, EXIT_ERROR, would only refuse it again)
NOT_RESTARTED = (EXIT_OK, EXIT_ERROR, EXIT_FENCED, EXIT_JOB_FAILED)


class CleaveError(Exception):
    """Base of every error Cleave raises deliberately."""

    exit_code = EXIT_ERROR  # the status of a process this error ends


# ---- input -------------------------------------------------------------------------------------------
class ConfigError(CleaveError):
    """A setting or job description is invalid; the message names the knob to change."""


class JobRefused(ConfigError):
    """A worker cannot take part in a job at all (it declared no own data, or a round would not fit its memory):
    it tells the PS so, with the reason, and is not dealt the job again."""


class WireError(CleaveError):
    """A message could not be decoded or failed validation; it is rejected, never used."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason  # short snake_case tag, used as a counter label


class TooLarge(WireError):
    def __init__(self, detail: str) -> None:
        super().__init__("too_large", detail)


class CreateRefused(CleaveError):
    """NATS refused to create a stream or bucket Cleave needs and none exists (`cleave.bus.create`); the message
    names it, its size and the server's reason (e.g. JetStream's storage cannot hold its limit)."""


class CorruptCheckpoint(CleaveError):
    """A checkpoint's bytes do not match its manifest (a chunk's hash, or its length)."""


class CorruptBundle(CleaveError):
    """A published model or tokenizer bundle does not match its id or its manifest (a chunk's hash, a length)."""


class BundleUnavailable(CleaveError):
    """No PS answered a worker's requests for a bundle (or the one that did could not send it)."""


# ---- planning and the fleet --------------------------------------------------------------------------
class PlanError(CleaveError):
    """No plan exists for this input (empty fleet, a GEMM no device can hold, ...); the message says why."""


class FleetGone(CleaveError):
    """Every device that could finish a GEMM left, and none joined in time (the simulator's engine)."""


class ProbeFailed(CleaveError):
    """Not even a small echo came back: nothing is known about the links."""


class NetlabError(CleaveError):
    """A namespace, link or qdisc could not be created or changed."""


# ---- a job on the PS ---------------------------------------------------------------------------------
class Conflict(CleaveError):
    """A compare-and-set lost: someone else wrote the key first."""


class Fenced(CleaveError):
    """Another PS took over this job (a higher epoch committed or claimed it)."""

    exit_code = EXIT_FENCED


class JobChanged(ConfigError):
    """A job id that already has state was started as another model, data order or privacy noise: refused once,
    not restarted (a new job id, or the job's own settings, resume it)."""

    exit_code = EXIT_JOB_FAILED


class StepSpoiled(CleaveError):
    """A step's result cannot be trusted (a worker was caught lying): it is redone, never applied."""


class StepAborted(CleaveError):
    """A training step could not finish (the job was stopped, or a GEMM ran past its timeout)."""

    exit_code = EXIT_JOB_FAILED  # when not stopping: the job cannot go on


class RoundsFailed(StepAborted):
    """`max_empty_rounds` rounds in a row ended with no accepted update: the job fails with what the PS saw."""

    exit_code = EXIT_JOB_FAILED


class ClientLost(CleaveError):
    """The split-learning client left: its half of the model went with it."""

    exit_code = EXIT_JOB_FAILED


class ReplicaLost(CleaveError):
    """Another replica could not be reached, or the group broke (a replica died mid-step)."""

    exit_code = EXIT_GROUP_LOST


class PsEnded(CleaveError):
    """A job's PS process ended with a non-zero `status`. The command that supervised it ends with the same
    status where it is the job's verdict (3: fenced, 4: the job cannot go on), else with EXIT_ERROR."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status

    @property
    def exit_code(self) -> int:
        return self.status if self.status in (EXIT_FENCED, EXIT_JOB_FAILED) else EXIT_ERROR


# ---- the command line --------------------------------------------------------------------------------
class Stopped(BaseException):  # noqa: N818 - like KeyboardInterrupt, a request, not an error
    """A stop signal reached the `cleave` command's supervisor; `signum` says which. A BaseException so that
    no `except Exception` between the signal and the command's clean-up swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
