"""The Python API: define a job, train it, read its metrics as the steps are committed.

    from cleave import Job, run

    job = Job(preset="tiny", steps=5, batch_size=4)
    for m in run(job, workers=2):            # a local stack: nats-server, scheduler, 2 workers, the PS
        print(m["step"], m["loss"], m["step_time_s"])

`run` is a generator: the stack starts at the first step asked for and stops when the loop ends, breaks or
raises (or when the generator is closed). `cleave train` is this loop with a progress bar. What the PS wrote
stays in the run dir (`runs/<job id>` by default): the metrics file, the logs, and the job's state in the
stack's JetStream store, which `cleave export --run-dir` reads and the same job id resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from cleave.api import credentials
from cleave.api.fleet import LocalFleet, reference_steps
from cleave.errors import ConfigError
from cleave.runtime.metrics_file import MetricsFile
from cleave.train.job import JobConfig

Job = JobConfig  # a job's every setting (docs/user-guide.md): Job(preset="small", steps=200, method="diloco", ...)
DEFAULT_WORKERS = 4  # as `cleave train`


def load_job(path: str | Path, **overrides: object) -> JobConfig:
    """A job from a settings file (TOML or JSON), with `overrides` over it; errors name the file and the key."""
    return JobConfig.load(path, **overrides)


def run_dir_of(job: JobConfig) -> Path:
    """Where a job keeps its files unless told: its own folder, so that the same job id finds its state again."""
    return Path("runs") / job.job_id


def run(job: JobConfig, *, workers: int = DEFAULT_WORKERS, run_dir: str | Path | None = None,
          nats: str | None = None, auth: str | Path | None = None, metrics_out: str | Path | None = None,
          ps_replicas: int = 1,
          reference: bool = False, on_stack: Callable[[LocalFleet], None] | None = None) -> Iterator[dict]:
    """Train `job`, yielding each step's metrics (a dict: step, loss, step_time_s, workers, tokens, lr, ...; for
    diloco and fedavg one per round) as the PS commits it.

    - `nats=None`: a local stack in `run_dir` (nats-server from the wheel, a scheduler and `workers` workers);
      `nats=URL`: a running stack's NATS, its scheduler and workers (`cleave up` prints the URL); the PS runs
      here and logs in with the PS credential of `auth` (the directory of `cleave auth init`) when given.
    - `reference=True`: the same job in this process in plain PyTorch, the yardstick of exactness.
    - `ps_replicas`: PS replicas, each training an equal share of every batch (method cleave).
    - `on_stack(fleet)`: called once the stack is up, before the PS starts (its URL: `fleet.stack.nats_url`).
    A PS that fails raises `cleave.errors.CleaveError` naming its log; nothing is left running either way.
    """
    run_dir = Path(run_dir) if run_dir is not None else run_dir_of(job)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_out = Path(metrics_out) if metrics_out is not None else run_dir / "metrics.jsonl"
    if reference:
        yield from reference_steps(job, metrics_out)
        return
    if auth is not None and nats is None:
        raise ConfigError("auth= logs the PS in to a running stack's NATS: it needs nats= (a local stack has none)")
    ps_env = credentials.role_env(Path(auth), "ps") if auth is not None else None
    fleet = LocalFleet(run_dir, workers, nats_url=nats)
    try:
        fleet.start(with_fleet=nats is None)
        if on_stack:
            on_stack(fleet)
        fleet.start_ps(job, metrics_out, ps_env=ps_env, replicas=ps_replicas)
        yield from fleet.follow_ps(metrics_out)
    finally:
        fleet.stop()


def metrics(run_dir: str | Path) -> list[dict]:
    """The committed steps' metrics of the job a run dir holds (each step once, in step order), e.g. after
    `train` or `cleave train` ended, or while it runs."""
    return MetricsFile(Path(run_dir) / "metrics.jsonl").lines()
