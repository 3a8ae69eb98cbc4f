"""`cleave plan`: plan every GEMM of a model's training step on a fleet and print the plan.

    cleave plan --model NAME --fleet FILE|synthetic:N --batch-size B --seq-len S [--precision fp32|bf16|fp16]
                [--ps-bandwidth BYTES_PER_S] [--seed S] [--json] [--no-assignments]
                [--recompute] [--micro-batches N] [--head-chunks N]

It plans the GEMMs that `cleave train --preset NAME --batch-size B --seq-len S` runs (the head in the job's
chunks of tokens, its input gradient over slices of the vocabulary, every element 4 bytes in a device's
memory). Without --json it prints one line per GEMM kind and the totals; with --json the document described
in docs/planning.md (the `ModelPlan` JSON plus the job's parameters and the even-split baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, TextIO

from cleave.errors import ConfigError, PlanError
from cleave.models import PRESETS, ModelConfig, StepLayout, gemm_shapes, get_preset
from cleave.plan.fleet import fleet_from_spec
from cleave.plan.planner import DTYPE_BYTES, ModelPlan, even_split_model, plan_model
from cleave.schemas.dtypes import COMPUTE_DTYPE_BYTES
from cleave.schemas.fleet import MAX_BANDWIDTH, MIN_BANDWIDTH


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `plan` subcommand to an argparse subparsers object; it dispatches to `run`."""
    p = subparsers.add_parser(
        "plan",
        help="plan a model's GEMMs on a fleet: devices, blocks, predicted step time vs lower bound",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, choices=sorted(PRESETS), help="a model preset")
    p.add_argument("--fleet", required=True, help="a fleet JSON file, or synthetic:N (the edge profile)")
    p.add_argument("--batch-size", "--batch", dest="batch", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-len", "--seq", dest="seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--precision", "--dtype", dest="dtype", choices=sorted(DTYPE_BYTES), default="fp32",
                   help="the job's precision: its tiles' element type on the wire (default fp32, as a job's)")
    p.add_argument(
        "--ps-bandwidth", type=float, default=None, help="the PS's egress in bytes/s (default: unlimited)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of a synthetic fleet")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--no-assignments", action="store_true", help="leave the per-device blocks out of the JSON"
    )
    p.add_argument("--recompute", action="store_true",
                   help="the job recomputes each block's forward in the backward (its GEMMs dealt again)")
    p.add_argument("--micro-batches", type=int, default=1, help="the batch in N equal parts (every GEMM N times)")
    p.add_argument("--head-chunks", type=int, default=None,
                   help="the head and loss of each micro-batch in N chunks of tokens (default: the job's, the "
                        "fewest whose float32 logits fit 256 MiB, as its dry run prints)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Entry point of `cleave plan` (argparse namespace from `register`)."""
    return plan_command(
        model=args.model,
        fleet=args.fleet,
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        ps_bandwidth=args.ps_bandwidth,
        seed=args.seed,
        as_json=args.json,
        assignments=not args.no_assignments,
        recompute=args.recompute,
        micro_batches=args.micro_batches,
        head_chunks=args.head_chunks,
    )


def plan_command(
    model: str,
    fleet: str,
    batch: int,
    seq: int,
    dtype: str = "fp32",
    ps_bandwidth: float | None = None,
    seed: int = 0,
    as_json: bool = False,
    assignments: bool = True,
    out: TextIO | None = None,
    layout: StepLayout | None = None,
    recompute: bool = False,
    micro_batches: int = 1,
    head_chunks: int | None = None,
) -> int:
    """Plan `model` on `fleet` and print the result to `out` (stdout); raises CleaveError on bad input. The step
    is the job's (`job_layout` of `recompute`, `micro_batches` and `head_chunks`), or `layout` where given."""
    out = out or sys.stdout
    cfg = check_job(model, batch, seq, dtype)
    if ps_bandwidth is not None:
        check_ps_bandwidth(ps_bandwidth)
    if seed < 0:  # (numpy's generator takes none)
        raise ConfigError(f"--seed must be at least 0, got {seed}")
    layout = layout or job_layout(model, batch, seq, recompute, micro_batches, head_chunks)
    if layout.micro_batches < 1 or batch % layout.micro_batches:
        raise ConfigError(f"--micro-batches must divide --batch {batch}, got {layout.micro_batches}")
    if layout.head_chunks < 1 or batch // layout.micro_batches * seq % layout.head_chunks:
        raise ConfigError(f"--head-chunks must divide a micro-batch's {batch // layout.micro_batches * seq} tokens, "
                          f"got {layout.head_chunks}")
    devices = fleet_from_spec(fleet, seed)
    shapes = gemm_shapes(cfg, batch, seq, layout)
    # elements travel in the job's precision and take float32 in a device's memory, as the PS tells the scheduler
    try:
        plan = plan_model(devices, shapes, DTYPE_BYTES[dtype], ps_bandwidth, COMPUTE_DTYPE_BYTES)
    except PlanError as e:  # (the planner's words name no flag: its weight gradients' k is a micro-batch's tokens)
        raise PlanError(f"{e}; for this job: a smaller --batch-size or --seq-len, more --micro-batches, or "
                        "devices with more memory") from None
    even = even_split_model(devices, shapes, DTYPE_BYTES[dtype], ps_bandwidth, COMPUTE_DTYPE_BYTES)
    if as_json:
        doc = {
            "model": model,
            "batch": batch,
            "seq": seq,
            "dtype": dtype,
            "fleet": fleet,
            "seed": seed,
            "recompute": layout.recompute,
            "micro_batches": layout.micro_batches,
            "head_chunks": layout.head_chunks,
            **plan.to_dict(assignments),
            "even_split_step_s": even.predicted_step_s,
            "even_split_ratio": even.predicted_step_s / plan.predicted_step_s,
        }
        json.dump(doc, out)
        out.write("\n")
    else:
        _print_table(plan, even.predicted_step_s, f"{model} batch={batch} seq={seq} {dtype} on {fleet}", out)
    return 0


def job_layout(model: str, batch: int, seq: int, recompute: bool = False, micro_batches: int = 1,
               head_chunks: int | None = None) -> StepLayout:
    """How the job of `model` at `batch` x `seq` runs its step's GEMMs (`JobConfig.layout`, as its PS does):
    `head_chunks` where given, else the job's own."""
    if micro_batches < 1 or batch % micro_batches:
        raise ConfigError(f"--micro-batches must divide --batch {batch}, got {micro_batches}")
    from cleave.train.job import JobConfig  # (imports torch, as the GEMM shapes do)

    job = JobConfig(preset=model, batch_size=batch, seq_len=seq, recompute=recompute, micro_batches=micro_batches)
    layout = job.layout()
    return layout if head_chunks is None else replace(layout, head_chunks=head_chunks)


def check_ps_bandwidth(value: float, unlimited: str = "") -> None:
    """--ps-bandwidth within a link's range (`DeviceProfile`'s): a PS sending 1e-300 bytes/s overflowed every
    time to inf (and the simulator's engine to 'no worker left'); `unlimited` says how to ask for no limit."""
    if not MIN_BANDWIDTH <= value <= MAX_BANDWIDTH:
        raise ConfigError(f"--ps-bandwidth must be {MIN_BANDWIDTH:g} to {MAX_BANDWIDTH:g} bytes/s{unlimited}; got {value}")


def check_job(model: str, batch: int, seq: int, dtype: str, model_flag: str = "--model") -> ModelConfig:
    """The preset of a job's model, its batch, sequence length and precision checked (`cleave plan` and
    `cleave sim`); errors name the flag to change, `model_flag` for the model."""
    try:
        cfg = get_preset(model)
    except ValueError as e:
        raise ConfigError(f"{model_flag}: {e}") from None
    if batch <= 0:
        raise ConfigError(f"--batch-size must be a positive integer, got {batch}")
    if not 0 < seq <= cfg.block_size:
        raise ConfigError(f"--seq-len must be between 1 and {model}'s block_size {cfg.block_size}, got {seq}")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"--precision must be one of {', '.join(sorted(DTYPE_BYTES))}, got {dtype!r}")
    return cfg


def _print_table(plan: ModelPlan, even_step_s: float, title: str, out: TextIO) -> None:
    out.write(f"{title}\n")
    out.write(
        f"{'gemm':<28} {'m':>7} {'n':>7} {'k':>7} {'count':>5} {'devices':>7} {'makespan s':>11} "
        f"{'bound s':>10} {'gap':>7}\n"
    )
    for g in plan.gemms:
        out.write(
            f"{g.name:<28} {g.m:>7} {g.n:>7} {g.k:>7} {g.count_per_step:>5} {g.devices_used:>7} "
            f"{g.makespan_s:>11.4g} {g.lower_bound_s:>10.4g} {g.gap:>7.2%}\n"
        )
    out.write(
        f"predicted step {plan.predicted_step_s:.4g} s, lower bound {plan.lower_bound_s:.4g} s "
        f"(gap {plan.gap:.2%}); {plan.devices_used} of {plan.n_devices} devices used; "
        f"even split over all devices {even_step_s:.4g} s ({even_step_s / plan.predicted_step_s:.2f}x); "
        f"planned in {plan.plan_time_s:.3f} s\n"
    )
