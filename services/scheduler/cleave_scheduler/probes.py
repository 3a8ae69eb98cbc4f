"""The echo of the workers' link probes (pure, but for the clock passed in): whom to answer and how much.

A request names its own reply subject, and the answer goes out with the answering connection's rights: a
probe whose reply named a plan key or a JetStream API subject once made the scheduler overwrite the plan or
purge the registry. So a probe arrives on its worker's own subject (`cleave.probe.<id>`, the only one a
per-worker credential may publish probes on) and is answered only on that worker's own inbox
(`_INBOX.worker.<id>.…`, the only one its credential may read: `cleave.auth.reply_refusal`, which the PS's
answers to model requests obey too), from a connection whose credential may publish nowhere else
(`scheduler-probe` of `cleave auth init`). Each worker id may draw at most
`DEFAULT_BURST_BYTES` of echoes at once, refilled at `DEFAULT_RATE_BYTES_PER_S` (a measurement takes ~11 MB:
growing probes up to 4 MiB each way): past it, its probes go unanswered and it measures a slow link.
"""

from __future__ import annotations

from collections import OrderedDict

from cleave.auth import reply_refusal, requester
from cleave.schemas import MAX_PROBE_BYTES, SUBJECT_PROBE_FROM, Probe

DEFAULT_BURST_BYTES = 32 * 1024 * 1024  # echo bytes one worker may draw at once (three measurements)
DEFAULT_RATE_BYTES_PER_S = 1024 * 1024  # ... and per second after
MAX_TRACKED = 100_000  # worker ids whose budget is remembered (the least recently seen are forgotten)


def prober(subject: str) -> str:
    """The worker id a probe subject names ('' when it names none)."""
    return requester(SUBJECT_PROBE_FROM, subject)


def refusal(subject: str, reply: str) -> str:
    """Why a probe on `subject` must not be answered on `reply` ('' when it may): only its sender's inbox."""
    return reply_refusal(SUBJECT_PROBE_FROM, subject, reply)


class ProbeDesk:
    """Echoes within each worker's byte budget."""

    def __init__(self, max_payload: int, burst: int = DEFAULT_BURST_BYTES,
                 rate: float = DEFAULT_RATE_BYTES_PER_S) -> None:
        self.max_payload, self.burst, self.rate = max_payload, burst, rate
        self._left: OrderedDict[str, tuple[float, float]] = OrderedDict()  # worker -> (bytes left, at)
        self.refused = 0  # probes over their worker's budget

    def answer(self, probe: Probe, worker: str, now: float) -> Probe | None:
        """The echo for `worker`'s probe, or None when it is over its budget."""
        size = min(probe.reply_bytes, MAX_PROBE_BYTES, self.max_payload - 1024)
        cost = size + len(probe.payload)
        left, at = self._left.pop(worker, (float(self.burst), now))
        left = min(float(self.burst), left + (now - at) * self.rate)
        if cost > left:
            self.refused += 1
            self._keep(worker, left, now)
            return None
        self._keep(worker, left - cost, now)
        return Probe(payload=bytes(size))

    def _keep(self, worker: str, left: float, now: float) -> None:
        self._left[worker] = (left, now)
        while len(self._left) > MAX_TRACKED:
            self._left.popitem(last=False)
