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

import atexit
import functools
import math
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from cleave import codec
from cleave.api import credentials, hub, state
from cleave.api.args import EXPORT_PRECISIONS, JobId, blocking, checked
from cleave.api.fleet import LocalFleet, reference_steps
from cleave.api.stack import hold
from cleave.errors import CleaveError, ConfigError
from cleave.methods import export as methods_export
from cleave.methods.aggregate import DEFAULT_TRIM, trim_cut
from cleave.models.hf import CONFIG_FILE, WEIGHTS_FILE, check_weights, read_hf_config, resolve_model_dir
from cleave.models.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from cleave.models.tokenizer import DEFAULT_TOKENIZER, TOKENIZER_FILES, TOKENIZER_RECORD, load_tokenizer
from cleave.runtime.metrics_file import MetricsFile
from cleave.schemas import StateHead
from cleave.train import reading
from cleave.train.data import DEFAULT_MIN_TOKENS, Corpus, check_token_file, check_vocab
from cleave.train.identity import refusal
from cleave.train.job import ROUND_METHODS, JobConfig
from cleave.train.sources import check_source, parse_source
from cleave.train.trainer import check_init

Job = JobConfig  # a job's every setting (docs/user-guide.md): Job(preset="small", steps=200, method="diloco", ...)
DEFAULT_WORKERS = 4  # as `cleave train`
# what an export writes in its folder (`cleave.models.hf.export_hf`, the default adapter folder)
EXPORT_NAMES = frozenset({CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_RECORD, *TOKENIZER_FILES, methods_export.ADAPTER_DIR})
# what an adapter export writes in its folder (`cleave.models.peft.write_adapter`, a seed-started job's base)
ADAPTER_NAMES = frozenset({ADAPTER_CONFIG, ADAPTER_WEIGHTS, methods_export.BASE_DIR})
# text data smaller than this on disk is read whole before a stack starts (a token is rarely over 64 bytes), so
# that one too small to train on is told at once, not by the PS once a stack has started
SMALL_DATA_BYTES = 64 * DEFAULT_MIN_TOKENS


@checked
def load_job(path: str | Path, **overrides: object) -> JobConfig:
    """A job from a settings file (TOML or JSON), with `overrides` over it (an override of None is no override);
    errors name the file and the key."""
    return JobConfig.load(path, **{k: v for k, v in overrides.items() if v is not None})


@checked
def run_dir_of(job: JobConfig) -> Path:
    """Where a job keeps its files unless told: its own folder, so that the same job id finds its state again."""
    return Path("runs") / job.job_id


@checked
def run(job: JobConfig, *, workers: Annotated[int, Field(ge=1)] = DEFAULT_WORKERS, run_dir: str | Path | None = None,
        nats: str | None = None, auth: str | Path | None = None, metrics_out: str | Path | None = None,
        ps_replicas: Annotated[int, Field(ge=1, le=64)] = 1,
        reference: bool = False, on_stack: Callable[[LocalFleet], None] | None = None) -> Iterator[dict]:
    """Train `job`, yielding each step's metrics (a dict: step, loss, step_time_s, workers, tokens, lr, ...; for
    diloco and fedavg one per round) as the PS commits it. A job resumed from its state yields the steps it trains
    now, from the first not committed before (`metrics(run_dir)` has them all).

    - `nats=None`: a local stack in `run_dir` (nats-server from the wheel, a scheduler and `workers` workers);
      `nats=URL`: a running stack's NATS, its scheduler and workers (`cleave up` prints the URL); the PS runs
      here and logs in with the PS credential of `auth` (the directory of `cleave auth init`) when given.
    - `reference=True`: the same job in this process in plain PyTorch, the yardstick of exactness.
    - `ps_replicas`: PS replicas, each training an equal share of every batch (method cleave).
    - `on_stack(fleet)`: called once the stack is up, before the PS starts (its URL: `fleet.stack.nats_url`).
    A PS that fails raises `cleave.errors.CleaveError` naming its log; nothing is left running either way. A run
    dir is one job's: one that holds another job (its job.json) is refused. What the stack cannot run
    (`check_stack`) and what the PS cannot read or train on (`check_inputs`) raise ConfigError at the call.
    """
    check_auth(auth, nats)
    run_dir = Path(run_dir) if run_dir is not None else run_dir_of(job)
    try:
        held = state.job_id_of(run_dir)
    except ConfigError:  # no job.json (a new run dir), or none that names a job
        held = None
    if held not in (None, job.job_id):
        raise ConfigError(f"{run_dir} holds job {held!r} (its job.json, state and metrics): train {job.job_id!r} in a "
                          f"run dir of its own, or resume {held!r} under its id (--job-id {held} / job_id={held!r})")
    check_stack(job, workers, ps_replicas, local=nats is None and not reference)
    check_inputs(job)
    if nats is not None and not reference:
        hub.reachable(nats, Path(auth) if auth is not None else None, "ps")  # (named now, not retried for ever)
    return _run(job, workers, run_dir, nats, auth, metrics_out, ps_replicas, reference, on_stack)


def check_stack(job: JobConfig, workers: int, ps_replicas: int, local: bool) -> None:
    """What a job asks of the stack it runs on, told before one starts (`local`: a stack of `workers` workers
    started for it, none with data of its own): a PS replica with no worker waited for ever, and a round that
    can never apply an update trained nothing, step after step, and a trimmed mean of too few was the mean."""
    if local and ps_replicas > workers:
        raise ConfigError(f"ps_replicas={ps_replicas} (--ps-replicas) needs at least as many workers (each replica "
                          f"trains with its own part of the fleet, and one with none waits for ever); workers="
                          f"{workers} (--workers)")
    if local and job.method in ROUND_METHODS and job.min_updates > workers and not job.max_staleness:
        raise ConfigError(f"min_updates={job.min_updates} (--min-updates) is more than the {workers} workers of this "
                          "stack: no round could ever apply an update (each worker sends one a round)")
    if local and job.secagg and workers < 2:
        raise ConfigError(f"secagg (--secagg) needs at least 2 workers (a sum of one update hides nothing); "
                          f"workers={workers} (--workers)")
    if local and job.aggregate == "trimmed" and not trim_cut(workers, DEFAULT_TRIM):
        raise ConfigError(f"aggregate=trimmed (--aggregate) drops {DEFAULT_TRIM:g} of a round's updates at each end, "
                          f"none of fewer than {math.ceil(1 / DEFAULT_TRIM)}: with workers={workers} (--workers) it "
                          "is the plain mean; use --aggregate median, or more workers")
    if local and job.own_data:
        raise ConfigError("own_data (--own-data) trains only on data the workers declared themselves (cleave worker "
                          "--data SOURCE), and a local stack's workers declare none: run the job on a hub whose "
                          "workers do (cleave up, then submit or run with nats=URL; docs/methods.md)")
    if job.batch_size % (ps_replicas * job.micro_batches) or (ps_replicas > 1 and job.method != "cleave"):
        raise ConfigError(f"ps_replicas={ps_replicas} (--ps-replicas) needs method cleave and a batch size divisible "
                          f"by it times micro_batches (the job has method {job.method}, batch size {job.batch_size}, "
                          f"micro-batches {job.micro_batches})")


def check_inputs(job: JobConfig) -> None:
    """What the PS reads (it runs here, with nats= too): a tokenizer, model folder or data it cannot read, that
    does not fit the model, is no text or too short to train on, is told now (`run`, `cleave train` and its dry
    run, the hub's runner), not once a stack has started. A device or a pipe as tokenizer is refused by the rule
    that reading data follows (`reading.check_regular`): one is read for ever, the other blocks its reader."""
    if job.tokenizer != DEFAULT_TOKENIZER and not Path(job.tokenizer).expanduser().is_dir():
        reading.check_regular(Path(job.tokenizer).expanduser(), f"tokenizer={job.tokenizer!r}")
    tok = load_tokenizer(job.tokenizer)
    if job.init_from is not None:
        try:
            resolve_model_dir(job.init_from)
        except ConfigError as e:
            raise ConfigError(f"init_from: {e}") from None
    arch = job.arch()  # (a job without a preset reads it from init_from)
    check_vocab(tok.name, tok.vocab_size, arch.vocab_size, job.model_name)
    if job.init_from is not None:
        check_init(read_hf_config(job.init_from), arch, job)
        check_weights(job.init_from)
    src = parse_source(job.data)
    size = check_source(src)  # (text that looks binary is refused)
    if src.kind == "tokens":  # (its sidecar: the tokenizer it was made with, its vocabulary)
        check_token_file(src, tok.name, arch.vocab_size, job.model_name)
    elif src.kind in ("text", "folder", "glob", "jsonl") and size < SMALL_DATA_BYTES:
        Corpus.for_job(job, tokenizer=tok)  # (too few tokens or examples: read now, it takes milliseconds)


def check_auth(auth: str | Path | None, nats: str | None) -> None:
    if auth is not None and nats is None:
        raise ConfigError("auth (--auth) logs the PS in to a running stack's NATS: it needs nats (--nats URL); a "
                          "local stack has no credentials")


def writable(run_dir: Path, metrics_out: str | Path | None) -> Path:
    """Make the run dir and the metrics file's folder, and open the metrics file (default: the run dir's
    metrics.jsonl) to append, before any process starts; returns the metrics file. A path that cannot be used is
    named with its option ("afile: File exists" said neither which option nor that a file was in the way)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run dir {run_dir} (--run-dir) cannot be used: {_why(e, run_dir)}") from None
    metrics_out = Path(metrics_out) if metrics_out is not None else run_dir / "metrics.jsonl"
    try:
        metrics_out.parent.mkdir(parents=True, exist_ok=True)
        open(metrics_out, "a").close()
    except OSError as e:
        raise ConfigError(f"metrics file {metrics_out} (--metrics-out) cannot be written: "
                          f"{_why(e, metrics_out)}") from None
    return metrics_out


def _why(e: OSError, path: Path) -> str:
    if isinstance(e, IsADirectoryError):
        return f"it is a folder; name a file, e.g. {path / 'metrics.jsonl'}"
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if isinstance(e, FileExistsError | NotADirectoryError) and blocker is not None:
        return f"{blocker} is a file, where a folder is needed"
    return e.strerror or str(e)


def _run(job: JobConfig, workers: int, run_dir: Path, nats: str | None, auth: str | Path | None,
         metrics_out: str | Path | None, ps_replicas: int, reference: bool,
         on_stack: Callable[[LocalFleet], None] | None) -> Iterator[dict]:
    metrics_out = writable(run_dir, metrics_out)
    held: list[int] = []  # the locks of the run dir (a stack's: LocalFleet's) and of the metrics file
    if reference:
        try:
            held.append(hold(run_dir))  # (a stack of the same job there would write the same metrics file)
            held += _hold_metrics(run_dir, metrics_out)
            yield from reference_steps(job, metrics_out)
        finally:
            for fd in held:
                os.close(fd)
        return
    ps_env = credentials.role_env(Path(auth), "ps") if auth is not None else None
    fleet = LocalFleet(run_dir, workers, nats_url=nats, one_machine=True)
    stop = functools.cache(fleet.stop)  # once: at the end, or at exit for a generator left unfinished (closed only
    atexit.register(stop)  # when collected, too late to stop a stack cleanly)
    try:
        held += _hold_metrics(run_dir, metrics_out)
        fleet.start(with_fleet=nats is None)
        if on_stack:
            on_stack(fleet)
        _refuse_changed(job, fleet.stack.nats_url, auth)
        fleet.start_ps(job, metrics_out, ps_env=ps_env, replicas=ps_replicas)
        yield from fleet.follow_ps(metrics_out, new_only=True)
    finally:
        atexit.unregister(stop)
        _uninterrupted(stop)
        for fd in held:
            os.close(fd)


def _uninterrupted(stop: Callable[[], None]) -> None:
    """`stop`, run to its end even when Ctrl-C comes again meanwhile (a notebook's interrupt pressed twice left
    nats-server running, its run dir free for another stack on the same store); that Ctrl-C is raised once the
    stack is down. Under another SIGINT handler (`cleave train`'s: a second signal exits at once), as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        stop()
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: pressed.append(signum))
    try:
        stop()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:
        raise KeyboardInterrupt


def _hold_metrics(run_dir: Path, metrics_out: Path) -> list[int]:
    """The metrics file's lock (`hold`), none for one that is no regular file (/dev/null, a pipe) or whose folder
    takes no lock file (/dev): nothing to keep apart there."""
    if not metrics_out.is_file():
        return []
    try:
        return [hold(run_dir, metrics_out)]
    except OSError:  # (not CleaveError: the file is in use)
        return []


def _refuse_changed(job: JobConfig, url: str, auth: str | Path | None) -> None:
    """A job id whose state is of another model, data order or privacy noise is refused here, before the run dir's
    job.json is rewritten with settings that never ran (its PS, reading the same head, would refuse it too)."""
    head = blocking(state.head_of(url, job.job_id, Path(auth) if auth is not None else None, "ps"))
    if head is not None and (refused := refusal(job.job_id, head.job_config, head.step, job.model_dump_json())):
        raise refused


@checked
def metrics(run_dir: str | Path) -> list[dict]:
    """The committed steps' metrics of the job a run dir holds (each step once, in step order), e.g. after
    `train` or `cleave train` ended, or while it runs (none yet: an empty list)."""
    if Path(run_dir).is_file():
        raise ConfigError(f"{run_dir} is a file, not a run dir: name the run's folder (metrics(run_dir)), or read a "
                          "metrics file of your own (metrics_out=) directly, one JSON object a line")
    if not Path(run_dir).is_dir():
        raise ConfigError(f"{run_dir} is no run dir (no such folder)")
    return MetricsFile(Path(run_dir) / "metrics.jsonl").lines()


@dataclass(frozen=True)
class Exported:
    out: Path  # the Hugging Face model directory (a LoRA job's adapters merged)
    adapter: Path | None  # a LoRA job's PEFT adapter directory, else None
    job: JobConfig
    head: StateHead  # the checkpoint exported: its step (from 0) and epoch


@checked
def export(out: str | Path, *, run_dir: str | Path | None = None, nats: str | None = None,
           auth: str | Path | None = None, job_id: JobId | None = None,
           precision: Literal["fp32", "bf16", "fp16", "float32", "bfloat16", "float16"] = "fp32",
           adapter_out: str | Path | None = None) -> Exported:
    """Write a job's model, as of its last committed checkpoint, as a Hugging Face model directory `out` (and a
    LoRA job's PEFT adapter, by default in `out/adapter`), as `cleave export` does: from a run dir (`run_dir`;
    the job in its job.json unless `job_id` names another) or from any NATS holding the job's state (`nats`,
    `job_id` required; `auth`: the directory with the submitter's credential). `precision`: fp32, bf16 or fp16."""
    if (run_dir is None) == (nats is None):
        raise ConfigError("export needs exactly one of run_dir (a local run) and nats (a NATS holding the state)")
    if precision not in EXPORT_PRECISIONS:
        raise ConfigError(f"precision={precision!r}: choose fp32, bf16 or fp16")
    out = Path(out)
    for folder in (out, *([Path(adapter_out)] if adapter_out is not None else [])):
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{folder} is a file: the {'model' if folder is out else 'adapter'} is written as a "
                              "folder")
        if above := next((p for p in folder.parents if p.exists() and not p.is_dir()), None):
            raise ConfigError(f"{above} is a file: no folder can be made under it for {folder}")
    if adapter_out is not None and Path(adapter_out).resolve() == out.resolve():
        raise ConfigError(f"adapter_out (--adapter-out) {adapter_out} is the model's own folder: transformers would apply the adapter "
                          "again over the merged weights; leave it unset (it goes to OUT/adapter) or name another")
    if adapter_out is not None and out.resolve().is_relative_to(Path(adapter_out).resolve()):
        raise ConfigError(f"adapter_out (--adapter-out) {adapter_out} holds the model's folder {out}: the adapter's folder is replaced "
                          "whole; leave it unset (it goes to OUT/adapter) or name another")
    adapters = Path(adapter_out) if adapter_out is not None else None
    inside = adapters is not None and adapters.resolve().is_relative_to(out.resolve())
    # (an adapter folder right inside `out` is part of the earlier export: the same command run again replaces both)
    own = {adapters.resolve().name} if inside and adapters.resolve().parent == out.resolve() else set()
    replaceable(out, written=EXPORT_NAMES | own)
    if adapters is not None:
        replaceable(adapters, ADAPTER_CONFIG, ADAPTER_NAMES, "adapter export")
    if nats is not None:
        if not job_id:
            raise ConfigError("export from a hub's NATS (--nats, nats=) needs the job's id (--job-id, job_id=): "
                              "`cleave status --nats URL` lists the hub's jobs")
        head, job, cfg, model = blocking(state.read_state(nats, job_id, Path(auth) if auth else None))
    else:
        with state.state_server(Path(run_dir)) as url:
            head, job, cfg, model = blocking(state.read_state(url, job_id or state.named_job(Path(run_dir), url)))
    for what, spec in (("init_from", job.init_from), ("tokenizer", job.tokenizer)):
        home = Path(spec).expanduser() if spec else None
        if home is not None and home.exists() and home.resolve().is_relative_to(out.resolve()):
            raise ConfigError(f"{out} holds the job's own {what} ({spec}): the export would replace it; export into "
                              "another folder")
    if adapter_out is not None and not job.lora_rank:
        raise ConfigError(f"adapter_out (--adapter-out) {adapter_out}: job {job.job_id!r} has no LoRA adapters (lora_rank=0); "
                          "its export is the model alone")
    dtype = codec.torch_dtype(EXPORT_PRECISIONS[precision])
    try:  # (an adapter folder inside `out` is written inside its staging; one elsewhere is staged and swapped with it)
        with replacing(out, *([adapters] if adapters and not inside else [])) as (staging, *beside):
            written, *adapter = methods_export.export(
                model, job, cfg, staging, dtype, staging / adapters.resolve().relative_to(out.resolve()) if inside
                else next(iter(beside), None), home=out, adapter_home=adapters)
    except OSError as e:  # a full disk, a folder it may not write: nothing of the export is left
        raise CleaveError(f"cannot write the export to {out}: {e.filename or ''} {e.strerror or e}; nothing was "
                          "written") from None
    return Exported(written, adapter[0] if adapter else None, job, head)


def replaceable(out: Path, mark: str = TOKENIZER_RECORD, written: frozenset[str] = EXPORT_NAMES,
                what: str = "export") -> None:
    """Refuse an `out` that holds anything but an earlier export: an export replaces its folder whole, and nothing
    else there may be lost (an earlier export is known by its `mark`: the tokenizer record; an adapter export's,
    its adapter_config.json; it holds only what an export writes, `written`)."""
    names = {p.name for p in out.iterdir()} if out.is_dir() else set()
    if names and mark not in names:
        raise ConfigError(f"{out} holds other files and is not an earlier {what} (a run dir, a "
                          f"model of your own?): export into a new or empty folder, or over an earlier {what} "
                          "(replaced whole)")
    if extra := sorted(names - written):
        raise ConfigError(f"{out} is an earlier {what} but also holds {', '.join(extra[:5])}: an "
                          "export replaces its folder whole; move them, or export into another folder")


@contextmanager
def replacing(*outs: Path) -> Iterator[list[Path]]:
    """A new folder beside each of `outs` to write an export into, each put in its folder's place once all are
    written whole: an earlier export there is replaced, none of its files left behind (a stale tokenizer would
    win over the new model's), and a write or a swap that fails (a full disk, a signal between two swaps)
    leaves every one of them as it was (a model and its adapter elsewhere are never from two exports)."""
    outs = [out.resolve() for out in outs]  # (`.` has no name to stage beside)
    stagings: list[Path] = []
    try:
        for out in outs:
            out.parent.mkdir(parents=True, exist_ok=True)
            stagings.append(Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)))
            stagings[-1].chmod(0o755)  # (mkdtemp's 0700: an export is shared like any folder of the user's)
        yield stagings
        for out, staging in zip(outs, stagings, strict=True):
            if out.exists():
                out.rename(staging.with_suffix(".old"))
            staging.rename(out)
    except BaseException:
        for out, staging in zip(outs, stagings, strict=False):
            old = staging.with_suffix(".old")
            if not staging.exists() and out.exists():  # (swapped in already: it goes back out)
                out.rename(staging)
            if old.exists() and not out.exists():  # (the earlier export goes back)
                old.rename(out)
            shutil.rmtree(staging, ignore_errors=True)
        raise
    for staging in stagings:
        shutil.rmtree(staging.with_suffix(".old"), ignore_errors=True)
