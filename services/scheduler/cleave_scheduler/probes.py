"""The echo of the workers' link probes (pure, but for the clock passed in): whom to answer and how much.

A request names its own reply subject, and the answer goes out with the answering connection's rights: a
probe whose reply named a plan key or a JetStream API subject once made the scheduler overwrite the plan or
purge the registry. So a probe arrives on its worker's own subject (`cleave.probe.<id>`, the only one a
per-worker credential may publish probes on) and is answered only on that worker's own inbox
(`_INBOX.worker.<id>.…`, the only one its credential may read: `cleave.auth.reply_refusal`, which the PS's
answers to model requests obey too), from a connection whose credential may publish nowhere else
(`scheduler-probe` of `cleave auth init`). Each worker id may draw (`cleave.runtime.budgets`) at most
`DEFAULT_BURST_BYTES` of echoes at once, refilled at `DEFAULT_RATE_BYTES_PER_S` (a measurement takes ~11 MB:
growing probes up to 4 MiB each way). A worker id is no bound where every worker may claim any id (the shared
credential): all echoes together draw from one more budget, `total_burst` at once and `total_rate` after
(settings `echo_burst_bytes`, `echo_bytes_per_s`), so over any t seconds the echoes sent hold at most
total_burst + total_rate * t + one echo, whatever ids are claimed. That budget may go into debt by one echo, so
that a large echo is answered in its turn rather than starved by small ones; an echo of nothing (latency, an
upload's answer) never waits for it. Past either budget a `refusable` probe is told when to ask again (an
answer of tens of bytes, as an empty echo is); any other goes unanswered.
"""

from __future__ import annotations

from collections import Counter

from cleave.auth import reply_refusal, requester
from cleave.runtime.budgets import MAX_KEYS, Budgets, refilled
from cleave.schemas import MAX_PROBE_BYTES, SUBJECT_PROBE_FROM, Probe
from cleave.schemas.fleet import MAX_PROBE_RETRY_S

DEFAULT_BURST_BYTES = 32 * 1024 * 1024  # echo bytes one worker may draw at once (three measurements)
DEFAULT_RATE_BYTES_PER_S = 1024 * 1024  # ... and per second after
DEFAULT_TOTAL_BURST_BYTES = 256 * 1024 * 1024  # echo bytes all workers together may draw at once (~48 measurements)
DEFAULT_TOTAL_RATE_BYTES_PER_S = 32 * 1024 * 1024  # ... and per second after (~6 measurements of a fast link)
MIN_RETRY_S = 0.05  # the shortest wait a refusal names
HELD_NEWS_S = 60.0  # refusals are told (`news`) at most this often
NEWS_TOP = 5  # the worker ids that drew the most echo bytes since `news` last told, named in it


def prober(subject: str) -> str:
    """The worker id a probe subject names ('' when it names none)."""
    return requester(SUBJECT_PROBE_FROM, subject)


def refusal(subject: str, reply: str) -> str:
    """Why a probe on `subject` must not be answered on `reply` ('' when it may): only its sender's inbox."""
    return reply_refusal(SUBJECT_PROBE_FROM, subject, reply)


class ProbeDesk:
    """Echoes within each worker's byte budget and within the budget of all workers together."""

    def __init__(self, max_payload: int, burst: int = DEFAULT_BURST_BYTES, rate: float = DEFAULT_RATE_BYTES_PER_S,
                 total_burst: int = DEFAULT_TOTAL_BURST_BYTES,
                 total_rate: float = DEFAULT_TOTAL_RATE_BYTES_PER_S) -> None:
        self.max_payload, self.own = max_payload, Budgets(burst, rate)  # each worker id's
        self.total_burst, self.total_rate = total_burst, total_rate
        self._total: tuple[float, float] | None = None  # (bytes left of all workers' budget, at); None: full
        self.refused = 0  # probes over their worker's budget
        self.refused_total = 0  # probes within it, but over the budget of all workers together
        self._told: tuple[int, float] = (0, float("-inf"))  # (refusals, when) `news` last told
        self._drawn: Counter[str] = Counter()  # echo bytes each worker id drew since then (at most MAX_KEYS ids)

    def answer(self, probe: Probe, worker: str, now: float) -> Probe | None:
        """The echo for `worker`'s probe; over a budget, a refusal saying when to ask again (None when the
        probe is not `refusable`)."""
        size = min(probe.reply_bytes, MAX_PROBE_BYTES, self.max_payload - 1024)
        cost = min(size + len(probe.payload), self.own.burst)  # (one larger than the whole budget takes all of it)
        wait = self.own.wait(worker, cost, now)
        if wait:
            self.refused += 1
        elif wait := self._take_total(size, now):
            self.refused_total += 1
        if wait:
            return Probe(retry_after_s=min(max(wait, MIN_RETRY_S), MAX_PROBE_RETRY_S)) if probe.refusable else None
        self.own.take(worker, cost, now)
        if size and (worker in self._drawn or len(self._drawn) < MAX_KEYS):
            self._drawn[worker] += size
        return Probe(payload=bytes(size))

    def news(self, now: float) -> dict | None:
        """The refusals so far, when there are new ones since last told and that was HELD_NEWS_S ago (for the
        operator's log: workers waiting to measure their links), with who drew the echoes since then: how many
        worker ids and the NEWS_TOP that drew the most bytes (a flood's ids); None otherwise."""
        count, at = self._told
        if self.refused + self.refused_total == count or now - at < HELD_NEWS_S:
            return None
        self._told = (self.refused + self.refused_total, now)
        drawn, self._drawn = self._drawn, Counter()
        return {"over_worker_budget": self.refused, "over_total_budget": self.refused_total,
                "drawn_by": len(drawn), "top_drawers": dict(drawn.most_common(NEWS_TOP))}

    def _take_total(self, size: int, now: float) -> float:
        """Take `size` echo bytes of all workers' budget (0.0), or the seconds until it has any again. It may
        go into debt by one echo: whoever asks once it is above zero is answered, a large echo as a small one."""
        left = refilled(self._total, self.total_burst, self.total_rate, now)
        if size and left <= 0:
            self._total = (left, now)
            return max(-left / self.total_rate, MIN_RETRY_S)
        self._total = (left - size, now)
        return 0.0
