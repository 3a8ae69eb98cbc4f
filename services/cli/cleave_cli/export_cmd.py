"""`cleave export`: a run's current model (the PS's last committed checkpoint) as a Hugging Face model dir.

The PS persists its state in JetStream (`cleave_ps.state.persist`): the KV bucket `cleave-state` holds the head
record `<job>.head`, which names a streamed checkpoint (a manifest and a data object, `cleave.train.checkpoint`)
in the Object Store `cleave-state-objects`; the weights stream straight into the exported model.
The export reads them from the run's NATS when it is still running (`<run_dir>/stack.json`), or else from a
temporary nats-server started on the run's store (`<run_dir>/jetstream`) and stopped afterwards; or, with
`--nats URL`, from any NATS that holds the job's state (a hub, a compose deployment), logged in with the
submitter's credential from `--auth DIR`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cleave.api.args import EXPORT_PRECISIONS
from cleave.runtime.logs import configure
from cleave_cli.progress import unit_of


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a run's current model as a Hugging Face model directory")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path, help="the run dir of `cleave train` (stack.json, jetstream/)")
    where.add_argument("--nats", help="a NATS holding the job's state, e.g. the hub's tls://hub.example.org:4222")
    p.add_argument("--auth", type=Path, help="with --nats: the directory holding submitter.env (and the CA)")
    p.add_argument("--out", type=Path, required=True, help="the model directory to write")
    p.add_argument("--job-id", help="default: the job in <run-dir>/job.json (with --nats: required)")
    p.add_argument("--precision", "--dtype", dest="dtype", choices=EXPORT_PRECISIONS, default="fp32",
                   metavar="fp32|bf16|fp16", help="the saved weights' precision (default fp32)")
    p.add_argument("--adapter-out", type=Path, help="a LoRA job's PEFT adapter directory (default: <out>/adapter); "
                                                   "--out gets the model with the adapters merged")


def run(args: argparse.Namespace) -> int:
    from cleave.api import jobs  # (torch: `cleave --help` starts without it)
    from cleave_cli.jobs_cmd import quiet

    configure("export", level="error")  # the client's reconnect chatter is not for this command's user
    quiet()
    done = jobs.export(args.out, run_dir=args.run_dir, nats=args.nats, auth=args.auth, job_id=args.job_id,
                       precision=args.dtype, adapter_out=args.adapter_out)
    head, job = done.head, done.job
    print(
        f"exported job {job.job_id} after {unit_of(job.method)} {head.step} ({head.step + 1} of {job.steps} done; "
        f"committed by PS run {head.epoch}, model {job.model_name}, tokenizer {job.tokenizer}) to {done.out}"
        + (f"; its LoRA adapter (PEFT) to {done.adapter}" if done.adapter else "")
    )
    return 0
