"""One PS job, whatever its method: the lifecycle every driver goes through, and what each failure exits with.

A job joins what must agree first (a replica group), claims an epoch (fencing off an older PS of the same
job), builds its model, resumes from its last commit, subscribes to what the workers send, follows the
scheduler's plans (`PlanWatch`) and runs its steps (rounds, for DiLoCo and FedAvg) from the first one not
committed, committing and reporting each once; then it ends, in one of these ways:

| how it ends | exit status |
|---|---|
| every step committed, or stopped on request (a step in flight is not applied) | 0 |
| another PS took the job over (`Fenced`) | 3, not restarted |
| the job cannot go on: the split client left, or a step aborted without a stop (`ClientLost`, `StepAborted`) | 4, not restarted |
| a replica of the group is gone (`ReplicaLost`) | 5, restarted: the group re-forms from the last commit |
| any other `CleaveError` (a bad setting or input) | 2 |

A method is a `Driver` (Flower's split of a strategy from its transport): pretraining (`pretrain.py`),
rounds (`rounds.py`) and split learning (`split.py`) say what to build, what to listen to and what a step
is; this module does the rest, in this order, for all three.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from cleave.bus import Bus
from cleave.errors import EXIT_OK, CleaveError, ClientLost, Fenced, ReplicaLost, StepAborted
from cleave.schemas import Plan, StepMetrics, Wire
from cleave.train.job import JobConfig
from cleave_ps.fleet.plans import PlanWatch
from cleave_ps.state.persist import Progress

log = structlog.get_logger("ps")
ENDINGS: dict[type[CleaveError], str] = {  # what ends a running job, and the event it is logged as
    Fenced: "ps_fenced",
    ReplicaLost: "replica_group_lost",
    ClientLost: "split_client_lost",
    StepAborted: "step_aborted",
}
JobEnded = tuple(ENDINGS)


@dataclass(frozen=True)
class Listen:
    """A subject the job subscribes to once it has its epoch, and how (`Bus.subscribe`'s options)."""

    subject: str
    schema: type[Wire]
    handler: Callable[[Any, int], Awaitable[None]]
    options: dict[str, Any] = field(default_factory=dict)


class Driver(Protocol):
    """A method's part of a job: the verbs the lifecycle calls, in this order."""

    job: JobConfig
    progress: Progress  # its commits; `open` claims the epoch
    plan_key: str  # the plan bucket key it follows

    async def join(self) -> None:
        """Before the epoch: agree with whoever must agree first (a replica group; else nothing)."""

    async def build(self, epoch: int, plans: PlanWatch) -> None:
        """Build the model, its optimizer and whatever deals its work, for this epoch."""

    async def resume(self) -> int:
        """Restore the last commit; the first step (or round) to run."""

    def listens(self, epoch: int) -> Sequence[Listen]:
        """What the workers send this job."""

    async def on_plan(self, plan: Plan) -> None:
        """A new plan from the scheduler."""

    async def step(self, n: int) -> StepMetrics | None:
        """Run step (or round) `n`; its metrics line, or None when stopping (nothing applied)."""

    async def commit(self, m: StepMetrics) -> None:
        """Commit the step's outcome when due and report its line once."""

    async def finish(self, first: int) -> None:
        """Every step is committed: say so."""

    def stopping(self) -> None:
        """A stop was asked for: what is in flight ends without being applied."""

    def close(self) -> None:
        """Release what the job holds outside this process (a replica group)."""


async def run(driver: Driver, bus: Bus, stop: asyncio.Event) -> int:
    """The job from start to end; its exit status (the table above)."""
    try:
        await driver.join()
        epoch = await driver.progress.open()
        plans = PlanWatch(bus, driver.plan_key, driver.on_plan)
        await driver.build(epoch, plans)
        first = await driver.resume()
        subs = [await bus.subscribe(ln.subject, ln.schema, ln.handler, **ln.options) for ln in driver.listens(epoch)]
        try:
            return await _steps(driver, plans, first, stop)
        finally:
            for sub in subs:
                await sub.unsubscribe()
    except JobEnded as e:
        return ended(e, stop)
    finally:
        driver.close()


async def _steps(driver: Driver, plans: PlanWatch, first: int, stop: asyncio.Event) -> int:
    code, failed = EXIT_OK, None

    async def stop_then_abort() -> None:
        await stop.wait()
        driver.stopping()  # a GEMM or round in flight ends: the step is not applied

    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(plans.follow(stop))
        tg.create_task(stop_then_abort())
        try:
            for n in range(first, driver.job.steps):
                if stop.is_set():
                    break
                m = await driver.step(n)
                if m is None:
                    break
                await driver.commit(m)
            else:  # every step ran (none, when a restarted PS finds the job already done)
                await driver.finish(first)
        except JobEnded as e:
            code = ended(e, stop)
        except CleaveError as e:  # raised as itself once the group is done (not as an ExceptionGroup): its
            failed = e  # one line and exit status (a store too small for a checkpoint: 2)
        finally:
            stop.set()  # the job is over: the process ends with it
            watcher.cancel()
    if failed is not None:
        raise failed
    return code


def ended(e: CleaveError, stop: asyncio.Event) -> int:
    """The exit status of a job that `e` ended: a step aborted by a requested stop is a clean stop."""
    event = ENDINGS[next(t for t in ENDINGS if isinstance(e, t))]
    if isinstance(e, StepAborted) and stop.is_set():
        log.info(event, reason=str(e))
        return EXIT_OK
    log.warning(event, reason=str(e), exit_code=e.exit_code)
    print(f"cleave: error: {e}", file=sys.stderr, flush=True)  # (its supervisor's `last_words`: the reason, not
    return e.exit_code                                           # the bus's closing lines logged after it)
