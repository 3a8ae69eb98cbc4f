"""A job's committed state, read from wherever it lives: a run dir (its NATS while it runs, else a temporary
nats-server on its JetStream store) or any NATS holding it (a hub, with the submitter's credential). What
`cleave export` and `cleave.export` read: the job's head record and the model with the checkpoint's weights."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import torch
from nats.js.errors import BucketNotFoundError

from cleave import bus as busmod
from cleave.api.args import blocking
from cleave.api.hub import connect, unanswered
from cleave.api.stack import Stack, hold
from cleave.errors import CleaveError, ConfigError
from cleave.methods.export import job_model
from cleave.models import ModelConfig
from cleave.schemas import STATE_BUCKET, STATE_OBJECTS, StateHead
from cleave.train.checkpoint import read_checkpoint
from cleave.train.job import JobConfig

DEFAULT_PROBE_TIMEOUT_S = 1.0  # a run's NATS that does not greet within this is taken for gone


def job_id_of(run_dir: Path) -> str:
    path = run_dir / "job.json"
    try:
        return json.loads(path.read_text())["job_id"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read the job id from {path} ({e}): name the job (--job-id, job_id=)") from None


# ---------------------------------------------------------------- reaching the run's state


def _answers_as_nats(url: str) -> bool:
    """True when a NATS server greets us at `url` (its first line is INFO {...})."""
    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname, u.port or 4222), timeout=DEFAULT_PROBE_TIMEOUT_S) as s:
            return s.recv(4).startswith(b"INFO")
    except OSError:
        return False


def running_nats(run_dir: Path) -> str | None:
    """The URL of the run's own nats-server if it is still up, else None."""
    try:
        stack = json.loads((run_dir / "stack.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    url = stack.get("nats_url") or ""
    nats = [
        p for p in stack.get("processes", []) if p.get("role") == "nats" and p.get("running") and p.get("pid")
    ]
    if not url or not nats:
        return None
    try:
        os.kill(nats[0]["pid"], 0)
    except (ProcessLookupError, PermissionError):
        return None
    return url if _answers_as_nats(url) else None


@contextlib.contextmanager
def state_server(run_dir: Path) -> Iterator[str]:
    """A NATS URL serving the run's JetStream state: the live one, or a temporary server on its store, which
    holds the run dir meanwhile (`hold`: a stack started there is refused until it is done)."""
    url = running_nats(run_dir)
    if url:
        yield url
        return
    store = run_dir / "jetstream"
    if not store.is_dir():
        stackless = "" if (run_dir / "stack.json").exists() else (
            ": no stack ran there (a --reference run, trained in its own process, keeps no checkpoint to export)")
        raise ConfigError(elsewhere(run_dir) or f"{run_dir} has no running NATS (stack.json) and no JetStream store "
                          f"({store}){stackless}")
    lock = hold(run_dir)  # (a stack started there meanwhile would share the store with this server)
    try:
        with tempfile.TemporaryDirectory(prefix="cleave-export-") as tmp:
            # Stack keeps its store at <dir>/jetstream: point that at the run's store
            (Path(tmp) / "jetstream").symlink_to(store.resolve(), target_is_directory=True)
            stack = Stack(Path(tmp))
            try:
                yield stack.start_nats()
            finally:
                stack.stop_all()
    finally:
        os.close(lock)


def elsewhere(run_dir: Path) -> str | None:
    """Why a run dir of a job trained on a running stack's NATS (`cleave train --nats`) holds no state, and where
    its state is; None for any other run dir."""
    try:
        stack = json.loads((run_dir / "stack.json").read_text())
        url = stack.get("nats_url") or ""
        own = [p for p in stack.get("processes", []) if p.get("role") == "nats"]
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if not url or own:
        return None
    try:
        job_id = job_id_of(run_dir)
    except ConfigError:
        job_id = "ID"
    return (f"{run_dir} is the run dir of a job trained on the NATS at {url}, which keeps the job's state: export it "
            f"from there (cleave export --nats {url} --job-id {job_id} --out OUT, with --auth DIR on a hub that "
            "asks for credentials)")


def job_of(head: StateHead) -> JobConfig:
    """The job a head record was committed for; a job started from a model folder that is not here (moved, or the
    PS ran on another machine) names that folder: its config.json gives the model's shape."""
    fields = json.loads(head.job_config)
    try:
        return JobConfig.build(**fields)
    except ConfigError as e:
        if not fields.get("init_from"):
            raise
        raise ConfigError(f"job {head.job!r} started from init_from={fields['init_from']}, whose config.json gives "
                          f"the model's shape, and it cannot be read here ({e}): export where that folder is, or "
                          "put a copy of it at that path") from None


def split_not_exported(job: JobConfig) -> str:
    """Why a split-learning job has no model to export."""
    k = job.split_layers
    client = "the embeddings" + ("" if k == 0 else " and block 0" if k == 1 else f" and blocks 0-{k - 1}")
    return (f"job {job.job_id!r} is split learning (method split): its PS checkpoints only its half of the model "
            f"(blocks {k} on, the final norm and the head); {client} are the client worker's, which "
            "keeps them to itself, so there is no whole model to export")


async def _state_bucket(bus: busmod.Bus, url: str):  # noqa: ANN202 - nats-py's KeyValue
    """The PSs' state bucket at `url`; None where no PS ever persisted there."""
    try:
        return await asyncio.wait_for(bus.js.key_value(STATE_BUCKET), busmod.DEFAULT_TIMEOUT_S)
    except BucketNotFoundError:
        return None
    except Exception as e:
        raise CleaveError(f"the PS state at {url} could not be read ({type(e).__name__})." + unanswered(e)) from None


async def _jobs_in(bus: busmod.Bus, kv) -> str:  # noqa: ANN001 - nats-py's KeyValue
    """The ids of the jobs with a committed checkpoint in the state bucket `kv`, for a message."""
    return ", ".join(k.removesuffix(".head") for k in await bus.keys(kv) if k.endswith(".head")) or "none"


async def _jobs_at(url: str) -> str:
    bus = await connect(url, None)  # (a run dir's own NATS, or one started on its store: no credential)
    try:
        kv = await _state_bucket(bus, url)
        return "none" if kv is None else await _jobs_in(bus, kv)
    finally:
        await bus.close()


def named_job(run_dir: Path, url: str) -> str:
    """The job a run dir's job.json names; a run dir without one (a hub's, which holds many jobs) is refused with
    the jobs that have a checkpoint at `url`, its NATS."""
    if (run_dir / "job.json").exists():
        return job_id_of(run_dir)
    raise ConfigError(f"{run_dir} has no job.json naming its job (a hub's run dir holds many): name one (--job-id, "
                      f"job_id=); jobs with a committed checkpoint there: {blocking(_jobs_at(url))}")


async def head_of(url: str, job_id: str, auth_dir: Path | None = None, role: str = "submitter") -> StateHead | None:
    """The job's last committed head record at `url` (logging in as `role` with the credential in `auth_dir`);
    None for a job with no state there yet."""
    bus = await connect(url, auth_dir, role)
    try:
        kv = await _state_bucket(bus, url)
        got = await bus.kv_get(kv, f"{job_id}.head", StateHead) if kv is not None else None
        return got[0] if got else None
    finally:
        await bus.close()


async def read_state(url: str, job_id: str, auth_dir: Path | None = None
                     ) -> tuple[StateHead, JobConfig, ModelConfig, torch.nn.Module]:
    """The job's last committed head record, its job and model config, and the model with the checkpoint's
    weights (every key, shape and chunk hash checked; the optimizer's state is skipped). `auth_dir`: log in
    with the submitter's credential found there."""
    bus = await connect(url, auth_dir)  # (a clear error when NATS does not answer)
    try:
        kv = await _state_bucket(bus, url)
        if kv is None:
            raise CleaveError(f"{url} holds no persisted PS state (no {STATE_BUCKET} bucket)")
        got = await bus.kv_get(kv, f"{job_id}.head", StateHead)
        if got is None:
            raise CleaveError(f"job {job_id!r} has no committed checkpoint; jobs with one: {await _jobs_in(bus, kv)}")
        head, _ = got
        job = job_of(head)
        if job.method == "split":
            raise ConfigError(split_not_exported(job))
        cfg = job.arch()
        model = job_model(job)  # every weight is overwritten by the checkpoint
        try:
            store = await asyncio.wait_for(bus.js.object_store(STATE_OBJECTS), busmod.DEFAULT_TIMEOUT_S)
        except Exception as e:  # the head record is there, its objects are not: a damaged or partial store
            raise CleaveError(f"{url} holds the head of job {job_id!r} (step {head.step}) but no checkpoint store "
                              f"{STATE_OBJECTS} ({type(e).__name__}): the store is damaged or incomplete") from None
        await read_checkpoint(bus.js, store, head, model, None, skip_optimizer=True)
        return head, job, cfg, model
    finally:
        await bus.close()
