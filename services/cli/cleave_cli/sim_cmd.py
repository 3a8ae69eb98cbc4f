"""`cleave sim`: simulate training steps of a model on a large edge fleet, and compare with the baselines.

    cleave sim --model opt-13b [--fleet synthetic:N|FILE] [--devices N] --batch 128 --seq 1024 [--dtype fp16]
               [--churn RATE] [--stragglers FRACTION] [--hidden-stragglers] [--steps N] [--seed S]
               [--memory BYTES] [--ps-bandwidth BYTES_PER_S] [--tile ROWSxCOLS] [--chunks N] [--window N]
               [--replan-every S] [--no-fanout] [--ps-flops F] [--ps-memory BYTES] [--ps-link BYTES_PER_S]
               [--systems a,b,...]
               [--json] [--report DIR]

Cleave is simulated GEMM by GEMM with the planner and the PS's tile ledger; the baselines (alpa, dp_tp,
dtfm, asteroid, pipeline) are cost models with a memory check. The PS is charged for its own work
(attention, norms, softmax and loss, the optimizer) at --ps-flops and its memory (weights, optimizer state,
saved activations) against --ps-memory; `systems.cleave.ps` says what bounds one PS's step, how many
data-parallel PS replicas the job needs and their gradient all-reduce on --ps-link. `--json` prints
`{"config": {...}, "systems": {NAME: {"step_s", "feasible", "recovery_s", "per_device_down_bytes",
"per_device_up_bytes", ...}}}`; `--report DIR` sweeps models and fleet sizes and writes report.json and
PNG plots there (docs/evaluation.md describes them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from cleave.errors import ConfigError
from cleave.gemm.ledger import MAX_WINDOW
from cleave.gemm.tiles import DEFAULT_TILE
from cleave.models import PRESETS
from cleave.plan.planner import DTYPE_BYTES
from cleave.schemas.fleet import (
    MAX_BANDWIDTH,
    MAX_FLOPS,
    MAX_MEMORY_BYTES,
    MIN_BANDWIDTH,
    MIN_FLOPS,
)
from cleave.schemas.plan import Plan
from cleave.sim.report import BASE_EXTRA_DEVICES, DEFAULT_DEVICES, DEFAULT_MODELS
from cleave.sim.systems import DEFAULT_FLEET_SIZE, DEFAULT_PS_BANDWIDTH
from cleave.sim.workload import Workload
from cleave_cli.plan_cmd import check_job, check_ps_bandwidth


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `sim` subcommand to an argparse subparsers object; it dispatches to `run`."""
    p = subparsers.add_parser(
        "sim",
        help="simulate training on a large edge fleet and compare with baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="opt-13b", choices=sorted(PRESETS), help="a model preset")
    p.add_argument("--devices", type=int, default=None,
                   help=f"devices in the fleet (default: all of --fleet; {DEFAULT_FLEET_SIZE} of --fleet synthetic)")
    p.add_argument("--fleet", default="synthetic",
                   help="synthetic:N (N devices of the edge profile) or a fleet JSON file, as cleave plan takes "
                        "them; synthetic: --devices of the edge profile")
    p.add_argument("--batch-size", "--batch", dest="batch", type=int, default=128, help="sequences per step")
    p.add_argument("--seq-len", "--seq", dest="seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--precision", "--dtype", dest="dtype", choices=sorted(DTYPE_BYTES), default="fp16",
                   help="the tiles' element type on the wire (default fp16: mixed precision, as the published "
                        "systems compared train at this scale)")
    p.add_argument("--churn", type=float, default=0.0, help="leaves per device-hour (joins keep the size)")
    p.add_argument("--stragglers", type=float, default=0.0, help="fraction of devices running at 0.1x")
    p.add_argument("--hidden-stragglers", action="store_true", help="stragglers register their full profile")
    p.add_argument("--steps", type=int, default=1, help="training steps to simulate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--memory", type=int, default=None, help="every device's memory in bytes (default: the fleet's own; 512 MiB in a synthetic fleet)"
    )
    p.add_argument(
        "--ps-bandwidth", type=float, default=None,
        help=f"the PS's egress, bytes/s (default {DEFAULT_PS_BANDWIDTH:g}: what one PS process sends, as measured; "
        "0: unlimited, as the published baselines assume)"
    )
    p.add_argument("--ps-flops", type=float, default=None,
                   help="the PS's FLOP/s for its own work (default 5e12: a 64-core cloud VM)")
    p.add_argument("--ps-memory", type=float, default=None,
                   help="one PS machine's memory in bytes (default 512 GiB)")
    p.add_argument("--ps-link", type=float, default=None,
                   help="bytes/s between PS replicas, for their all-reduce (default 1.25e9: 10 Gbit/s)")
    p.add_argument("--no-fanout", action="store_true",
                   help="send every block with its tile (the PS's CLEAVE_PS_FANOUT=false)")
    p.add_argument("--tile", default=None, help="cut planned blocks into tiles of at most ROWSxCOLS")
    p.add_argument("--chunks", type=int, default=4,
                   help="a planned block goes out in at least N pieces, streamed (1 to 64; 1: whole blocks)")
    p.add_argument("--window", type=int, default=1, help="tiles in flight per worker beyond its planned pieces")
    p.add_argument("--deferred", type=int, default=0,
                   help="weight gradients dealt beside the backward's input gradients, at most N waiting (the "
                        "PS's deferred_gemms, 8 there by default; 0 here: one GEMM at a time, faster to simulate)")
    p.add_argument(
        "--replan-every",
        type=float,
        default=0.0,
        help="seconds between fresh layouts (default: every change)",
    )
    p.add_argument("--systems", default=",".join(_systems()), help="comma-separated systems to run")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument(
        "--report", type=Path, default=None, help="sweep models and fleet sizes; write JSON and PNGs"
    )
    p.add_argument("--report-models", default=None,
                   help=f"models of the sweep, comma-separated (default {','.join(DEFAULT_MODELS)}); the churn "
                        "curve runs --model if it is one of them, else the first")
    p.add_argument("--report-devices", default=None,
                   help=f"fleet sizes of the sweep, comma-separated (default {','.join(map(str, DEFAULT_DEVICES))}, "
                        f"and {','.join(map(str, BASE_EXTRA_DEVICES))} for the churn curve's model); the churn curve "
                        "runs on --devices if it is one of them, else the largest")
    return p


def _systems() -> tuple[str, ...]:
    from cleave.sim.systems import SYSTEMS

    return SYSTEMS


def _tile(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    rows, sep, cols = text.lower().partition("x")
    if not sep or not rows.isdigit() or not cols.isdigit() or int(rows) < 1 or int(cols) < 1:
        raise ConfigError(f"--tile {text!r}: expected ROWSxCOLS, e.g. 1024x1024")
    return int(rows), int(cols)


MAX_TILES = 10_000_000  # tiles one run deals at most: it deals some 40,000 a second (`--tile 1x1` never ended)


def check_tiles(model: str, batch: int, seq: int, tile: tuple[int, int] | None, steps: int) -> None:
    """A tile limit that cuts the run into more than MAX_TILES tiles is refused, with its count."""
    if tile is None:
        return
    tiles = steps * Workload.of(model, batch, seq).grid_tiles(*tile)
    if tiles > MAX_TILES:
        raise ConfigError(f"--tile {tile[0]}x{tile[1]} cuts {steps} step(s) of {model} at {batch} x {seq} tokens into "
                          f"at least {tiles:,} tiles; a run simulates at most {MAX_TILES:,} (some 40,000 a second): "
                          f"give larger tiles (the runtime's default is {DEFAULT_TILE}x{DEFAULT_TILE})")


def _most(model: Any, field: str) -> int:
    """The largest value a schema's field takes (its `le`)."""
    return next(rule.le for rule in model.model_fields[field].metadata if getattr(rule, "le", None) is not None)


def config(args: argparse.Namespace) -> Any:
    """The `SimConfig` of these flags, checked."""
    from cleave.sim.systems import SimConfig, fleet_spec, parse_systems

    for flag, value, low in (
        ("--devices", 1 if args.devices is None else args.devices, 1),
        ("--steps", args.steps, 1),
        ("--window", args.window, 1),
        ("--chunks", args.chunks, 1),
        ("--deferred", args.deferred, 0),
        ("--seed", args.seed, 0),
    ):
        if value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}")
    if args.window > MAX_WINDOW:  # (a million simulated for minutes, 1.6 GB: the PS's own limit)
        raise ConfigError(f"--window must be 1 to {MAX_WINDOW}, as the PS's window setting; got {args.window}")
    most = _most(Plan, "chunks")  # (a plan carries no more: the runtime never streams more pieces)
    if args.chunks > most:
        raise ConfigError(f"--chunks must be 1 to {most}, as the scheduler's plan carries it; got {args.chunks}")
    check_job(args.model, args.batch, args.seq, args.dtype)  # as cleave plan checks them
    check_tiles(args.model, args.batch, args.seq, _tile(args.tile), args.steps)
    for flag, value in (("--report-models", args.report_models), ("--report-devices", args.report_devices)):
        if value is not None and args.report is None:  # (else one point was simulated and the sweep ignored)
            raise ConfigError(f"{flag} sets the sweep of --report DIR; give --report too")
    if args.memory is not None and not 1 <= args.memory <= MAX_MEMORY_BYTES:
        raise ConfigError(f"--memory must be 1 to {MAX_MEMORY_BYTES} bytes (a device profile's "
                          f"range), got {args.memory}")
    if not 0 <= args.replan_every < math.inf:
        raise ConfigError(f"--replan-every must be seconds, or 0 for every change; got {args.replan_every}")
    if not 0 <= args.stragglers <= 1 or not 0 <= args.churn < math.inf:  # (nan or inf churned forever)
        raise ConfigError("--stragglers must be in [0, 1] and --churn non-negative")
    if args.ps_bandwidth is not None and args.ps_bandwidth != 0:
        check_ps_bandwidth(args.ps_bandwidth, ", or 0 for unlimited")
    ps = {}
    for flag, key, low, high in (("--ps-flops", "ps_flops", MIN_FLOPS, MAX_FLOPS),
                                 ("--ps-memory", "ps_memory", 1, MAX_MEMORY_BYTES),
                                 ("--ps-link", "ps_link", MIN_BANDWIDTH, MAX_BANDWIDTH)):
        value = getattr(args, key)
        if value is not None:
            if not low <= value <= high:  # (a device profile's range: beyond it times overflow to inf)
                raise ConfigError(f"{flag} must be {low:g} to {high:g}; got {value}")
            ps[key] = value
    fleet, devices = fleet_spec(args.fleet, args.devices, args.seed)
    return SimConfig(
        model=args.model,
        devices=devices,
        fleet=fleet,
        batch=args.batch,
        seq=args.seq,
        dtype=args.dtype,
        churn=args.churn,
        stragglers=args.stragglers,
        hidden_stragglers=args.hidden_stragglers,
        seed=args.seed,
        steps=args.steps,
        memory_bytes=args.memory,
        ps_bandwidth=DEFAULT_PS_BANDWIDTH if args.ps_bandwidth is None else (args.ps_bandwidth or None),
        tile=_tile(args.tile),
        window=args.window,
        chunks=args.chunks,
        replan_every_s=args.replan_every,
        fan_out=not args.no_fanout,
        deferred=args.deferred,
        systems=parse_systems(args.systems),
        **ps,
    )


def run(args: argparse.Namespace) -> int:
    from cleave.sim.systems import compare

    cfg = config(args)
    if args.report is not None:
        from cleave.sim.report import ReportSpec, write_report

        spec = ReportSpec.of(cfg, args.report_models, args.report_devices)
        for model in spec.models:
            check_job(model, cfg.batch, cfg.seq, cfg.dtype, "--report-models")
            check_tiles(model, cfg.batch, cfg.seq, cfg.tile, cfg.steps)
        doc = write_report(spec, args.report, progress=sys.stderr)
        print(json.dumps({"report": str(args.report), "files": doc["files"]}))
        return 0
    doc = compare(cfg)
    if args.json:
        print(json.dumps(doc, indent=2, default=float))
    else:
        print_table(doc, sys.stdout)
    return 0


def _fmt(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if unit == "B" and x >= scale:
            return f"{x / scale:.1f}{suffix}B"
    return f"{x:,.1f}{unit}"


def print_table(doc: dict[str, Any], out: TextIO) -> None:
    c = doc["config"]
    out.write(
        f"{c['model']} ({c['params'] / 1e9:.2f}B parameters), batch {c['batch']} x {c['seq']} tokens, "
        f"{c['dtype']}, {c['devices']} devices ({c['fleet']}), churn {c['churn']}/device-hour, "
        f"stragglers {c['stragglers']}\n"
    )
    out.write(
        f"{'system':10s} {'step s':>12s} {'recovery s':>11s} {'down/dev':>10s} {'up/dev':>10s} "
        f"{'devices':>8s}  note\n"
    )
    for name, r in doc["systems"].items():
        step = _fmt(r["step_s"]) if r["feasible"] else "infeasible"
        out.write(
            f"{name:10s} {step:>12s} {_fmt(r['recovery_s']):>11s} {_fmt(r['per_device_down_bytes'], 'B'):>10s} "
            f"{_fmt(r['per_device_up_bytes'], 'B'):>10s} {r['devices_used']:>8d}  {r['note']}\n"
        )
    me = doc["systems"].get("cleave", {})
    if me.get("feasible"):
        rec = me["recovery"]
        out.write(
            f"cleave: scheduler's prediction {_fmt(me['predicted_step_s'])} s a step (planner's ideal "
            f"{_fmt(me['planner_ideal_step_s'])} s); recovery is the mean over the step's GEMMs, the slowest "
            f"{_fmt(rec['worst_s'])} s ({rec['worst']['gemm']})\n"
        )
        print_ps(me["ps"], out)


def print_ps(ps: dict[str, Any], out: TextIO) -> None:
    """The PS's line of the table: its own work, its memory, what bounds it, the replicas the job needs."""
    need = ps["replicas"]
    out.write(
        f"PS: own work {ps['flops']['total']:.3g} FLOP = {_fmt(ps['compute_s'])} s a step, memory "
        f"{_fmt(ps['memory_bytes']['total'], 'B')} (state {_fmt(ps['memory_bytes']['state'], 'B')}), egress "
        f"{_fmt(ps['egress_s'])} s; one PS is bound by {ps['bound']}; "
        + (f"{need} replica(s) needed: {_fmt(ps['with_replicas']['step_s'])} s a step, all-reduce "
           f"{_fmt(ps['with_replicas']['allreduce_s'])} s\n" if need else
           "no number of data-parallel replicas fits (the state alone exceeds --ps-memory)\n")
    )
