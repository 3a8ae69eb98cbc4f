"""The `cleave` command: run the services, a training job, the demo, or the local stack."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from cleave.errors import EXIT_INTERRUPTED, CleaveError, Stopped

TOOLS = {"chaos": "chaos_cmd", "monitor": "monitor_cmd", "auth": "auth_cmd", "plan": "plan_cmd",
         "export": "export_cmd", "prepare-data": "data_cmd", "sim": "sim_cmd", "swarm": "swarm_cmd"}  # module: register(sub), run(args)
LIGHT = ("chaos",)  # parsed alone, so that `cleave chaos kill` signals before torch is ever imported


def tool(name: str) -> ModuleType:
    return importlib.import_module(f"cleave_cli.{TOOLS[name]}")


def _service_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats", help="NATS URL (default: the service's setting, nats://127.0.0.1:4222)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (`only`, one of LIGHT) that subcommand alone, importing nothing else."""
    parser = argparse.ArgumentParser(prog="cleave", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    if only in LIGHT:
        tool(only).register(sub)
        return parser

    p = sub.add_parser("demo", help="train the small GPT on a local fleet, kill a worker midway, report")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--run-dir", type=Path)

    p = sub.add_parser("up", help="run nats, scheduler and workers in the foreground until Ctrl-C")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--nats-cluster", type=int, default=0, metavar="N",
                   help="N routed nats-servers with JetStream replicated (R3 from 3) instead of one")
    p.add_argument("--site", action="append", default=[], metavar="NAME",
                   help="a leaf node for site NAME (repeatable); the workers are dealt to the sites in turn")

    p = sub.add_parser("train", help="run one training job")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="a model preset: tiny, tiny-llama, small, gpt2-medium, llama3-1b")
    src.add_argument("--config", type=Path, help="a JSON job file (see docs/user-guide.md)")
    p.add_argument("--steps", type=int)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--job-id", help="names the job's persisted state; default: a new id per run")
    p.add_argument("--seed", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--data", help="builtin, a text file, folder, glob, data.jsonl[:field], hf:..., "
                                  "or tokens.u16/.u32/.bin")
    p.add_argument("--tokenizer", help="bytes (default), a tokenizer dir or tokenizer.json, or a cached repo id")
    p.add_argument("--init-from", help="a Hugging Face model dir to start from (fine-tuning)")
    p.add_argument("--nats", help="use this NATS (with its scheduler and workers) instead of a local stack")
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--metrics-out", type=Path)
    p.add_argument("--reference", action="store_true", help="run the same job in one process in plain PyTorch")
    p.add_argument("--ps-replicas", type=int, default=1, help="PS replicas, each training an equal share of every "
                   "batch with its own part of the fleet, gradients all-reduced (torch.distributed)")
    p.add_argument("--dry-run", action="store_true", help="print the preflight's memory estimate and exit")
    p.add_argument("--method", choices=("cleave", "diloco", "fedavg", "split"), help="how to train (default cleave)")
    p.add_argument("--split-layers", type=int, help="split learning: blocks the client keeps (default 1)")
    p.add_argument("--local-steps", type=int, help="diloco H / fedavg E: local steps per round")
    p.add_argument("--outer-lr", type=float, help="diloco's outer learning rate")
    p.add_argument("--outer-momentum", type=float, help="diloco's outer Nesterov momentum")
    p.add_argument("--diloco-setting", choices=("default", "paper", "plain"),
                   help="diloco's H, outer lr and momentum by name (the flags above win): default (measured on "
                        "small), paper (H 500, 0.7, Nesterov 0.9), plain (outer lr 1, no momentum)")
    p.add_argument("--round-timeout", type=float, dest="round_timeout_s",
                   help="diloco/fedavg: a round closes with what arrived after this many seconds (120)")
    p.add_argument("--max-staleness", type=int, help="diloco/fedavg: late updates up to this many rounds old "
                                                     "count, weighted 1/(1+age) (default 0: dropped)")
    p.add_argument("--min-updates", type=int, help="diloco/fedavg: a round closes once this many updates "
                                                   "arrived (default 0: every worker of the plan)")
    p.add_argument("--val-every", type=int, help="validation loss of the PS's model every N steps or rounds")
    p.add_argument("--aggregate", choices=("mean", "median", "trimmed"), help="how round updates combine")
    p.add_argument("--compress", help="updates on the uplink: none, fp16, bf16, int8[:BLOCK], topk:FRACTION")
    p.add_argument("--lora", type=int, dest="lora_rank", help="train and send only LoRA adapters of this rank")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="the GEMMs' precision (autocast "
                   "semantics; fp16 with loss scaling); --reference runs the same precision")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's block size)")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="activation checkpointing: each block keeps only its input and runs its forward again "
                        "(its GEMMs dealt again) in the backward (default: only when the batch does not fit)")
    p.add_argument("--micro-batches", type=int, help="split each batch in N equal parts, gradients accumulated")

    for name in TOOLS:
        tool(name).register(sub)

    p = sub.add_parser("ps", help="run the parameter server")
    _service_args(p)
    p.add_argument("--job", type=Path, help="JSON job file")
    p.add_argument("--metrics-out", type=Path)

    p = sub.add_parser("worker", help="run a worker")
    _service_args(p)
    p.add_argument("--worker-id")
    p.add_argument("--memory-bytes", type=int)
    p.add_argument("--profile", help="declared device to emulate: flops=..,down=..,up=..,latency=..,memory=..")

    p = sub.add_parser("scheduler", help="run the scheduler")
    _service_args(p)
    return parser


def _settings(cls, args: argparse.Namespace, **fields):
    values = {k: v for k, v in fields.items() if v is not None}
    if getattr(args, "nats", None):
        values["nats_url"] = args.nats
    return cls(**values)


def run_service(args: argparse.Namespace) -> int:
    if args.command == "ps":
        from cleave_ps.main import main as ps_main
        from cleave_ps.settings import PsSettings

        return ps_main(_settings(PsSettings, args, job_file=args.job, metrics_out=args.metrics_out))
    if args.command == "worker":
        from cleave_worker.main import main as worker_main
        from cleave_worker.settings import WorkerSettings

        return worker_main(_settings(WorkerSettings, args, worker_id=args.worker_id, memory_bytes=args.memory_bytes,
                                     profile=args.profile))
    from cleave_scheduler.main import main as scheduler_main
    from cleave_scheduler.settings import SchedulerSettings

    return scheduler_main(_settings(SchedulerSettings, args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in LIGHT else None).parse_args(argv)
    try:
        if args.command in ("ps", "worker", "scheduler"):
            return run_service(args)
        if args.command in TOOLS:
            return tool(args.command).run(args)
        from cleave_cli import commands
        from cleave_cli.supervisor import stop_signals

        try:
            with stop_signals():
                return getattr(commands, args.command)(args)
        except Stopped as e:
            print(f"cleave: stopped by {e}; the stack was shut down", file=sys.stderr)
            return e.exit_code
    except CleaveError as e:
        print(f"cleave: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
