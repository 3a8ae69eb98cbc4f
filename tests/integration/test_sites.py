"""A lab's deployment, as docs/deploy.md walks it, behind kernel-shaped links (cleave.runtime.netlab): a hub
namespace (`cleave up --listen 0.0.0.0 --auth DIR`), two site namespaces (`cleave site`, two workers each) and a
laptop namespace that submits a job and goes away, each behind its own link (100 Mbit/s down, 50 up), TLS and
credentials on everywhere.

- a site without a credential, and one with another deployment's credential, are refused and say so;
- the job (`tiny`) is submitted from the laptop, whose `cleave submit` returns once the hub has it;
- site A's link is cut for 10 s mid-run: the job goes on without it, and it comes back;
- the job finishes with every step once and the losses of `--reference`; both sites' workers computed tiles;
- `cleave status` reports it done and writes its metrics; `cleave export` over the network loads in transformers.
Needs root (skips with the reason otherwise); slow: about four minutes here.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cleave.api.fleet import run_reference
from cleave.runtime import netlab
from cleave.runtime.netlab import Link, Netlab
from cleave.train.job import JobConfig
from tests.integration.fleet import assert_same

WHY = netlab.unavailable()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=f"shaped-link lab unavailable: {WHY}"), pytest.mark.slow]

CLEAVE = [sys.executable, "-m", "cleave_cli"]
LINK = {"down": 100e6 / 8, "up": 50e6 / 8}  # a campus or home line: 100 Mbit/s down, 50 up
SITES = ("site-a", "site-b")
STEPS = 40
CUT_AT_STEP = 8  # once the hub reports this step, site A's link goes dead for CUT_S
CUT_S = 10.0
START_TIMEOUT_S = 180.0
JOB_TIMEOUT_S = 900.0
TILES = Path(__file__).parents[2] / "compose" / "e2e" / "registry_tiles.py"  # (shared with compose/e2e.sh)


class Running:
    """A long-lived command inside a namespace, its output in a file."""

    def __init__(self, lab: Netlab, ns: str, argv: list[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(lab.wrap(ns, argv), stdout=out, stderr=subprocess.STDOUT)

    def wait_for(self, text: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout_s}s: {self.log.read_text()[-3000:]}"
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def run_in(lab: Netlab, ns: str, argv: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(lab.wrap(ns, argv), capture_output=True, text=True, timeout=timeout_s)


def wait_file_line(path: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{path} has no {text!r} after {timeout_s}s"
        time.sleep(0.5)


@pytest.mark.timeout(1500)
def test_a_hub_and_two_sites_behind_shaped_links_train_a_job_submitted_from_a_laptop(tmp_path: Path) -> None:
    links = [Link(s, **LINK) for s in SITES] + [Link("laptop", **LINK)]
    lab = Netlab(links)
    auth, run = tmp_path / "auth", tmp_path / "hub"
    hosts = [a for link in links for a in ("--host", lab.hub_ip(link.id))]
    done = subprocess.run([*CLEAVE, "auth", "init", "--out", str(auth), "--tls", *hosts, "--sites", ",".join(SITES)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    laptop = tmp_path / "laptop"  # the submitter's credential and the CA, nothing else
    (laptop / "tls").mkdir(parents=True)
    shutil.copy(auth / "submitter.env", laptop / "submitter.env")
    shutil.copy(auth / "tls" / "ca.pem", laptop / "tls" / "ca.pem")
    job_id = f"sites-{time.time_ns()}"
    running: list[Running] = []
    t0 = time.monotonic()
    with lab:
        try:
            hub = Running(lab, lab.hub, [*CLEAVE, "up", "--listen", "0.0.0.0", "--auth", str(auth), "--workers", "0",
                                         "--run-dir", str(run)], tmp_path / "up.log")
            running.append(hub)
            hub.wait_for("stops everything")
            refused(lab, tmp_path, auth)
            for s in SITES:
                site = Running(lab, lab.ns(s), [*CLEAVE, "site", "--hub", f"tls://{lab.hub_ip(s)}:7422", "--name", s,
                                                "--auth", str(auth / "sites" / s), "--workers", "2",
                                                "--run-dir", str(tmp_path / s)], tmp_path / f"{s}.log")
                running.append(site)
            for site in running[1:]:
                site.wait_for("stops everything")
            nats = f"tls://{lab.hub_ip('laptop')}:4222"
            t_submit = time.monotonic()
            sub = run_in(lab, lab.ns("laptop"), [*CLEAVE, "submit", "--nats", nats, "--auth", str(laptop), "--preset",
                                                 "tiny", "--steps", str(STEPS), "--job-id", job_id, "--workers", "4"])
            t_submit = time.monotonic() - t_submit
            assert sub.returncode == 0 and f"{job_id}: queued" in sub.stdout, sub.stdout + sub.stderr
            left = subprocess.run(["ip", "netns", "pids", lab.ns("laptop")], capture_output=True, text=True)
            assert not left.stdout.split(), "the laptop keeps nothing running: the job is the hub's"
            cut = cut_mid_run(lab, run / "runner" / "jobs" / job_id / "metrics.jsonl")
            wait_file_line(run / "logs" / "runner.log", "job_done", JOB_TIMEOUT_S)
            assert cut.get("restored"), "the job ended before site A's link came back"
            tiles = tiles_done(lab, auth)
            status = run_in(lab, lab.ns("laptop"), [*CLEAVE, "status", "--nats", nats, "--auth", str(laptop),
                                                    "--job-id", job_id, "--json", "--metrics-out",
                                                    str(tmp_path / "status.jsonl")])
            assert status.returncode == 0, status.stderr
            export = run_in(lab, lab.ns("laptop"), [*CLEAVE, "export", "--nats", nats, "--auth", str(laptop),
                                                    "--job-id", job_id, "--out", str(tmp_path / "model")], 300)
            assert export.returncode == 0, export.stderr
        finally:
            codes = [r.stop() for r in reversed(running)]
    assert codes == [0] * len(codes), codes
    view = json.loads(status.stdout)
    assert (view["state"], view["done"], view["step"], view["steps_reported"]) == ("done", True, STEPS - 1, STEPS)
    for source in (run / "runner" / "jobs" / job_id / "metrics.jsonl", tmp_path / "status.jsonl"):
        steps = [json.loads(x)["step"] for x in source.read_text().splitlines()]
        assert steps == list(range(STEPS)), (source, steps)  # every step once
    lines = [json.loads(x) for x in (tmp_path / "status.jsonl").read_text().splitlines()]
    ref = run_reference(JobConfig.build(job_id=job_id, preset="tiny", steps=STEPS), tmp_path / "reference.jsonl")
    assert_same([m["loss"] for m in lines], [m["loss"] for m in ref])
    for s in SITES:  # each site's workers took part
        assert sum(n for w, n in tiles.items() if w.startswith(f"{s}-w")) > 0, tiles
    assert any(m["workers"] < 4 for m in lines) and lines[-1]["workers"] == 4, [m["workers"] for m in lines]
    loads_in_transformers(tmp_path / "model")
    diff = max(abs(m["loss"] - r["loss"]) / abs(r["loss"]) for m, r in zip(lines, ref, strict=True))
    print("RESULT", json.dumps({  # the figures docs/deploy.md quotes (pytest -s)
        "seconds": round(time.monotonic() - t0), "submit_s": round(t_submit, 1), "steps": STEPS,
        "workers_per_step": [m["workers"] for m in lines], "max_rel_loss_diff": diff,
        "recoveries": sum(m["recoveries"] for m in lines), "tiles_by_worker": tiles,
        "median_step_s": sorted(m["step_time_s"] for m in lines)[STEPS // 2]}))


def refused(lab: Netlab, tmp_path: Path, auth: Path) -> None:
    """A site without a credential, and one with another deployment's, exit non-zero saying why."""
    hub = f"tls://{lab.hub_ip('laptop')}:7422"
    empty = tmp_path / "no-credential"
    empty.mkdir()
    done = run_in(lab, lab.ns("laptop"), [*CLEAVE, "site", "--hub", hub, "--name", "site-c", "--auth", str(empty),
                                          "--workers", "0", "--run-dir", str(tmp_path / "site-c")])
    assert done.returncode != 0 and "no credential" in done.stderr, done.stderr
    other = tmp_path / "other-auth"
    made = subprocess.run([*CLEAVE, "auth", "init", "--out", str(other), "--sites", "site-a"], capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    shutil.copy(auth / "tls" / "ca.pem", other / "sites" / "site-a" / "ca.pem")  # the hub verifies; its key does not
    done = run_in(lab, lab.ns("laptop"), [*CLEAVE, "site", "--hub", hub, "--name", "site-a", "--auth", str(other),
                                          "--workers", "0", "--run-dir", str(tmp_path / "site-wrong")])
    assert done.returncode != 0 and "refused site site-a's credential" in done.stderr, done.stderr


def cut_mid_run(lab: Netlab, metrics: Path) -> dict:
    """Once the hub reports step CUT_AT_STEP, site A's link goes dead for CUT_S seconds (in the background)."""
    events: dict[str, float] = {}
    wait_file_line(metrics, f'"step": {CUT_AT_STEP},', JOB_TIMEOUT_S)
    lab.cut(SITES[0])
    events["cut"] = time.time()

    def restore() -> None:
        lab.restore(SITES[0])
        events["restored"] = time.time()

    threading.Timer(CUT_S, restore).start()
    return events


def tiles_done(lab: Netlab, auth: Path) -> dict[str, int]:
    """Tiles each worker reports done (the registry, read with the operators' credential inside the hub)."""
    done = run_in(lab, lab.hub, [sys.executable, str(TILES), "tls://127.0.0.1:4222", str(auth / "admin.nk"),
                                 str(auth / "tls" / "ca.pem")])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # (its logs go to stderr)


def loads_in_transformers(model: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        logits = hf(torch.arange(16).unsqueeze(0)).logits
    assert logits.shape[:2] == (1, 16) and torch.isfinite(logits).all()
