"""`cleave export`: a run's current model (the PS's last committed checkpoint) as a Hugging Face model dir.

The PS persists its state in JetStream (`cleave_ps.state.persist`): the KV bucket `cleave-state` holds the head
record `<job>.head`, which names a streamed checkpoint (a manifest and a data object, `cleave_ps.state.checkpoint`)
in the Object Store `cleave-state-objects`; the weights stream straight into the exported model.
The export reads them from the run's NATS when it is still running (`<run_dir>/stack.json`), or else from a
temporary nats-server started on the run's store (`<run_dir>/jetstream`) and stopped afterwards; or, with
`--nats URL`, from any NATS that holds the job's state (a hub, a compose deployment), logged in with the
submitter's credential from `--auth DIR`.
"""

from __future__ import annotations

import argparse
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

from cleave import bus as busmod
from cleave import codec
from cleave.errors import CleaveError, ConfigError
from cleave.methods.export import export, job_model
from cleave.models import ModelConfig
from cleave.runtime.logs import configure
from cleave.schemas import STATE_BUCKET, STATE_OBJECTS, StateHead
from cleave.train.job import JobConfig
from cleave_cli.progress import unit_of
from cleave_cli.stack import Stack
from cleave_ps.state.persist import read_checkpoint

DEFAULT_CONNECT_TIMEOUT_S = 15.0
DEFAULT_PROBE_TIMEOUT_S = 1.0
EXPORT_DTYPES = ("bfloat16", "float16", "float32")  # wire names (`cleave.codec.torch_dtype`)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's current model as a Hugging Face model directory")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path, help="the run dir of `cleave train` (stack.json, jetstream/)")
    where.add_argument("--nats", help="a NATS holding the job's state, e.g. the hub's tls://hub.example.org:4222")
    p.add_argument("--auth", type=Path, help="with --nats: the directory holding submitter.env (and the CA)")
    p.add_argument("--out", type=Path, required=True, help="the model directory to write")
    p.add_argument("--job-id", help="default: the job in <run-dir>/job.json (with --nats: required)")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="dtype of the saved weights")
    p.add_argument("--adapter-out", type=Path, help="a LoRA job's PEFT adapter directory (default: <out>/adapter); "
                                                   "--out gets the model with the adapters merged")


def run(args: argparse.Namespace) -> int:
    from cleave_cli.jobs_cmd import quiet

    configure("export", level="error")  # the client's reconnect chatter is not for this command's user
    quiet()
    if args.nats:
        if not args.job_id:
            raise ConfigError("--nats needs --job-id (`cleave status --nats URL` lists the hub's jobs)")
        job_id = args.job_id
        head, job, cfg, model = asyncio.run(read_state(args.nats, job_id, auth_dir=args.auth))
    else:
        job_id = args.job_id or job_id_of(args.run_dir)
        with state_server(args.run_dir) as url:
            head, job, cfg, model = asyncio.run(read_state(url, job_id))
    out, *adapter = export(model, job, cfg, args.out, codec.torch_dtype(args.dtype), args.adapter_out)
    print(
        f"exported job {job_id} after {unit_of(job.method)} {head.step} ({head.step + 1} of {job.steps} done; epoch "
        f"{head.epoch}, model {job.model_name}, tokenizer {job.tokenizer}) to {out}"
        + (f"; its LoRA adapter (PEFT) to {adapter[0]}" if adapter else "")
    )
    return 0


def job_id_of(run_dir: Path) -> str:
    path = run_dir / "job.json"
    try:
        return json.loads(path.read_text())["job_id"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read the job id from {path} ({e}); pass --job-id") from None


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
    """A NATS URL serving the run's JetStream state: the live one, or a temporary server on its store."""
    url = running_nats(run_dir)
    if url:
        yield url
        return
    store = run_dir / "jetstream"
    if not store.is_dir():
        raise ConfigError(f"{run_dir} has no running NATS (stack.json) and no JetStream store ({store})")
    with tempfile.TemporaryDirectory(prefix="cleave-export-") as tmp:
        # Stack keeps its store at <dir>/jetstream: point that at the run's store
        (Path(tmp) / "jetstream").symlink_to(store.resolve(), target_is_directory=True)
        stack = Stack(Path(tmp))
        try:
            yield stack.start_nats()
        finally:
            stack.stop_all()


async def _jobs_with_state(kv) -> list[str]:  # noqa: ANN001 - a nats-py KeyValue
    try:
        keys = await asyncio.wait_for(kv.keys(), busmod.DEFAULT_TIMEOUT_S)
    except Exception:  # nats-py raises NoKeysError for an empty bucket
        return []
    return sorted(k.removesuffix(".head") for k in keys if k.endswith(".head"))


async def read_state(url: str, job_id: str, auth_dir: Path | None = None
                     ) -> tuple[StateHead, JobConfig, ModelConfig, torch.nn.Module]:
    """The job's last committed head record, its job and model config, and the model with the checkpoint's
    weights (every key, shape and chunk hash checked; the optimizer's state is skipped). `auth_dir`: log in
    with the submitter's credential found there."""
    from cleave_cli.jobs_cmd import connect

    bus = await connect(url, auth_dir) if auth_dir is not None else await asyncio.wait_for(
        busmod.connect(url, "export"), DEFAULT_CONNECT_TIMEOUT_S)
    try:
        try:
            kv = await asyncio.wait_for(bus.js.key_value(STATE_BUCKET), busmod.DEFAULT_TIMEOUT_S)
        except Exception as e:
            raise CleaveError(f"{url} holds no persisted PS state ({type(e).__name__})") from None
        got = await bus.kv_get(kv, f"{job_id}.head", StateHead)
        if got is None:
            jobs = await _jobs_with_state(kv)
            raise CleaveError(
                f"job {job_id!r} has no committed checkpoint; jobs with one: {', '.join(jobs) or 'none'}"
            )
        head, _ = got
        job = JobConfig.build(**json.loads(head.job_config))
        cfg = job.arch()
        model = job_model(job)  # every weight is overwritten by the checkpoint
        store = await asyncio.wait_for(bus.js.object_store(STATE_OBJECTS), busmod.DEFAULT_TIMEOUT_S)
        await read_checkpoint(store, head, model, None, skip_optimizer=True)
        return head, job, cfg, model
    finally:
        await bus.close()
