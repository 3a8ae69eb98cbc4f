"""`cleave chaos`: kill, freeze, thaw or restart processes of a local stack, once or on a schedule.

Targets come from `<run_dir>/stack.json`, which the local supervisor rewrites whenever a process starts.
The supervisor brings back what is killed or restarted (as compose's restart policy would), except a
process killed with `--no-restart`: that writes `<run_dir>/held-down/<name>` before the signal, and the
supervisor leaves a process with such a marker dead. Imports stay light (no torch, no model): `cleave chaos`
signals within milliseconds of starting, and prints the time of each action to the millisecond.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
from pathlib import Path

from cleave.api.supervisor import HELD_DOWN_DIR
from cleave.errors import CleaveError

ACTIONS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP, "thaw": signal.SIGCONT, "restart": signal.SIGTERM}
ROLES = ("worker", "ps", "scheduler", "monitor", "nats", "runner")
RUNNER_DIR = "runner"  # `cleave up`'s runner keeps its jobs' PSs in a stack of their own, <run dir>/runner


def stamp() -> str:
    """Wall-clock time to the millisecond, e.g. 08:41:07.123."""
    now = time.time()
    return f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d}"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chaos", help="kill, freeze, thaw or restart processes of a local stack")
    p.add_argument("action", choices=sorted(ACTIONS))
    p.add_argument("--run-dir", type=Path, required=True, help="the stack's run dir (holds stack.json)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--role", choices=(*ROLES, "random"), default="worker")
    who.add_argument("--name", help="one process by name, e.g. worker-2")
    p.add_argument("--every", type=float, default=0.0, help="seconds between actions (with --count)")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--thaw-after", type=float, default=0.0, help="with freeze: send SIGCONT after this many seconds")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-restart", action="store_true", help="kill: the local supervisor leaves the victim dead")


START_SLACK_S = 2.0  # a process in stack.json is the one running under its pid if they started this close


def started(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), from /proc; None for no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines() if x.startswith("btime"))
    except (OSError, IndexError, StopIteration, ValueError):
        return None
    return boot + int(stat[19]) / os.sysconf("SC_CLK_TCK")


def runs_as_recorded(p: dict) -> bool:
    """Whether stack.json's process `p` runs under its pid: a pid whose process started at another time is another
    program's now (a stack whose supervisor was killed leaves stack.json saying its processes run)."""
    if not (p.get("running") and p.get("pid")):
        return False
    if not Path("/proc").is_dir():  # (no /proc: it cannot be told, and is trusted)
        return True
    t = started(p["pid"])
    return t is not None and abs(t - p.get("started_at", 0.0)) < START_SLACK_S


def targets(stack: dict, role: str, name: str | None) -> list[dict]:
    alive = [p for p in stack["processes"] if runs_as_recorded(p)]
    if name:
        return [p for p in alive if p["name"] == name]
    return alive if role == "random" else [p for p in alive if p["role"] == role]


def read_stack(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "stack.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CleaveError(f"cannot read {run_dir / 'stack.json'}: {e}") from None


def act(args: argparse.Namespace, rng: random.Random) -> dict:
    stack = read_stack(args.run_dir)
    found = targets(stack, args.role, args.name)
    if not found:
        gone = sum(bool(p.get("running")) and not runs_as_recorded(p) for p in stack["processes"])
        stale = (f" ({gone} it says run are gone or their pids are other programs' now: is the stack's "
                 "supervisor still running?)") if gone else ""
        if args.role == "ps" and not args.name and (args.run_dir / RUNNER_DIR / "stack.json").is_file():
            stale += f"; a hub's jobs run their PSs in --run-dir {args.run_dir / RUNNER_DIR}"
        raise CleaveError(f"no running process matches {args.name or args.role!r} in "
                          f"{args.run_dir / 'stack.json'}{stale}")
    proc = rng.choice(found)
    if args.no_restart:  # before the signal, so the supervisor sees it when it finds the process dead
        (args.run_dir / HELD_DOWN_DIR).mkdir(exist_ok=True)
        (args.run_dir / HELD_DOWN_DIR / proc["name"]).touch()
    try:
        os.kill(proc["pid"], ACTIONS[args.action])
    except ProcessLookupError:
        raise CleaveError(f"{proc['name']} (pid {proc['pid']}) is already gone") from None
    print(f"{stamp()} {args.action} {proc['name']} (role {proc['role']}, pid {proc['pid']})", flush=True)
    if args.action == "freeze" and args.thaw_after > 0:
        time.sleep(args.thaw_after)
        os.kill(proc["pid"], signal.SIGCONT)
        print(f"{stamp()} thaw {proc['name']} after {args.thaw_after}s", flush=True)
    return proc


def run(args: argparse.Namespace) -> int:
    if args.no_restart and args.action != "kill":
        raise CleaveError("--no-restart goes with kill")
    rng = random.Random(args.seed)
    for i in range(args.count):
        if i:
            time.sleep(args.every)
        act(args, rng)
    return 0
