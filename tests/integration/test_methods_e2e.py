"""DiLoCo and FedAvg over a real nats-server with worker processes: identities, churn, compression, LoRA."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cleave.api.fleet import LocalFleet
from cleave.train.job import JobConfig
from cleave.train.trainer import Trainer
from tests.integration.fleet import assert_same


def run_job(tmp_path, job: JobConfig, workers: int, victim_env: dict[str, str] | None = None) -> list[dict]:
    fleet = LocalFleet(tmp_path / "run", workers)
    try:
        fleet.start()
        if victim_env:
            fleet.stack.service("victim", "worker", ["--worker-id", "victim"], env=victim_env, restart=False)
        fleet.start_ps(job, tmp_path / "m.jsonl")
        return fleet.wait_ps(tmp_path / "m.jsonl", timeout_s=240)
    finally:
        fleet.stop()


@pytest.mark.parametrize("method,precision", [("diloco", "fp32"), ("fedavg", "fp32"),
                                              pytest.param("fedavg", "bf16", marks=pytest.mark.slow)])  # (~25 s)
def test_one_worker_one_local_step_equals_plain_training(tmp_path, method, precision):
    """diloco (outer SGD, lr 1, no momentum) and fedavg with one client and E=1 are plain training, in the
    job's precision (bf16: the same-precision reference)."""
    outer = {"outer_lr": 1.0, "outer_momentum": 0.0} if method == "diloco" else {}  # fedavg has no outer step
    job = JobConfig(job_id=f"id-{method}-{precision}", preset="tiny", steps=5, method=method, local_steps=1,
                    precision=precision, **outer)
    lines = run_job(tmp_path, job, workers=1)
    trainer = Trainer(JobConfig(preset="tiny", steps=5, precision=precision))
    assert_same([m["loss"] for m in lines], [trainer.step(s) for s in range(5)])


@pytest.mark.parametrize("method", ["diloco", pytest.param("fedavg", marks=pytest.mark.slow)])  # (fedavg ~14 s: slow)
def test_a_worker_killed_mid_round_is_tolerated(tmp_path, method):
    job = JobConfig(job_id=f"churn-{method}", preset="tiny", steps=6, method=method, local_steps=3,
                    round_timeout_s=30)
    lines = run_job(tmp_path, job, workers=2, victim_env={"CLEAVE_WORKER_FAIL_AT": "round:2",
                                                          "CLEAVE_WORKER_FAULT_DIR": str(tmp_path / "faults")})
    assert [m["step"] for m in lines] == list(range(6))
    assert [m["workers"] for m in lines][:2] == [3, 3] and lines[2]["workers"] == 2  # the round went on
    assert lines[-1]["loss"] < lines[0]["loss"]
    # the loss is reported: one recovery event in the round that lost the victim, none elsewhere
    assert [m["recoveries"] for m in lines] == [0, 0, 1, 0, 0, 0]
    (ev,) = lines[2]["recovery"]
    assert (ev["kind"], ev["worker_id"], ev["cause"], ev["step"]) == ("recovered", "victim", "left_plan", 2)
    assert 0 < ev["detect_s"] < 30 and ev["complete_s"] >= 0 and "dropped" in ev["detail"]
    assert "round_worker_lost" in (tmp_path / "run" / "logs" / "ps.log").read_text()


@pytest.mark.slow  # ~30 s; cleave's own PS-kill resumes stay in the default run (test_churn)
def test_diloco_ps_killed_mid_round_and_around_commits_resumes_exactly(tmp_path):
    """The global weights, the round and the outer momentum are committed after each round, and a worker asked
    for a round again answers with the update it computed (its inner AdamW steps once): killed three times,
    the run's losses are those of a run that was never killed."""

    def train(name: str, env: dict[str, str]) -> list[dict]:
        out = tmp_path / f"{name}.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "cleave_cli", "train", "--method", "diloco", "--preset", "tiny", "--steps", "6",
             "--workers", "2", "--local-steps", "2", "--job-id", name, "--metrics-out", str(out),
             "--run-dir", str(tmp_path / name)],
            capture_output=True, text=True, timeout=300, env={**os.environ, **env},
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [json.loads(line) for line in out.read_text().splitlines()]

    calm = train("calm", {})
    faults = tmp_path / "faults"
    crashy = train("crashy", {"CLEAVE_PS_FAIL_AT": "in_round:1,before_commit:3,after_commit:4",
                              "CLEAVE_PS_FAULT_DIR": str(faults), "CLEAVE_PS_PERSIST_EVERY": "1"})
    assert len(list(faults.iterdir())) == 3  # all three faults fired
    assert [m["step"] for m in crashy] == list(range(6))  # every round reported exactly once
    assert_same([m["loss"] for m in crashy], [m["loss"] for m in calm])
    # the rounds a restarted PS ran say so, as a step of method cleave does (they all said false)
    assert [m["resumed"] for m in crashy] == [False] + [True] * 5 and not any(m["resumed"] for m in calm)
    assert "round_replayed" in "".join(p.read_text() for p in (tmp_path / "crashy" / "logs").glob("worker*.log"))


def test_fedavg_with_lora_and_int8_updates(tmp_path):
    job = JobConfig(job_id="lora", preset="tiny", steps=4, method="fedavg", local_steps=2, lora_rank=4,
                    compress="int8", aggregate="median")
    lines = run_job(tmp_path, job, workers=3)
    assert [m["workers"] for m in lines] == [3] * 4
    # only the adapters travel, compressed: far fewer bytes than the model's weights
    full = sum(p.numel() for p in Trainer(JobConfig(preset="tiny")).model.parameters()) * 4
    assert all(m["raw_bytes_up"] < 0.2 * full * 3 for m in lines)
    assert all(m["bytes_up"] < m["raw_bytes_up"] for m in lines)
    assert lines[-1]["loss"] < lines[0]["loss"]


def test_cli_method_flags(tmp_path):
    out = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "cleave_cli", "train", "--method", "fedavg", "--preset", "tiny", "--steps", "2",
         "--workers", "2", "--local-steps", "1", "--compress", "bf16", "--metrics-out", str(out),
         "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 2 and all(m["workers"] == 2 for m in lines)


def test_split_learning_equals_plain_training(tmp_path):
    job = JobConfig(job_id="split", preset="tiny", steps=5, method="split", split_layers=1)
    lines = run_job(tmp_path, job, workers=2)
    trainer = Trainer(JobConfig(preset="tiny", steps=5))
    assert_same([m["loss"] for m in lines], [trainer.step(s) for s in range(5)])


@pytest.mark.slow  # ~20 s; cleave's own PS kills are in test_churn's default run
def test_split_learning_ps_killed_mid_step_and_around_commits_resumes_exactly(tmp_path):
    """The server half is committed after each step; the client keeps its state from before its last step
    and goes back to it when the restarted PS asks for that step again: the losses are plain training's."""
    out, faults = tmp_path / "m.jsonl", tmp_path / "faults"
    proc = subprocess.run(
        [sys.executable, "-m", "cleave_cli", "train", "--method", "split", "--preset", "tiny", "--steps", "6",
         "--workers", "1", "--job-id", "split-crashy", "--metrics-out", str(out), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "CLEAVE_PS_FAIL_AT": "in_step:1,before_commit:2,after_commit:4",
             "CLEAVE_PS_FAULT_DIR": str(faults), "CLEAVE_PS_PERSIST_EVERY": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(list(faults.iterdir())) == 3  # all three faults fired
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(6))
    trainer = Trainer(JobConfig(preset="tiny", steps=6))
    assert_same([m["loss"] for m in lines], [trainer.step(s) for s in range(6)])
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("worker*.log"))
    assert "split_step_rewound" in logs  # the kill before the commit made the client go back one step


@pytest.mark.slow  # ~12 s
def test_split_learning_says_clearly_when_its_client_is_lost(tmp_path):
    """The client half of the model lives only on the client: losing it ends the job with a clear error."""
    job = JobConfig(job_id="split-lost", preset="tiny", steps=6, method="split", round_timeout_s=20)
    fleet = LocalFleet(tmp_path / "run", 0)
    try:
        fleet.start()
        fleet.stack.service("victim", "worker", ["--worker-id", "a-victim"], restart=False,
                            env={"CLEAVE_WORKER_FAIL_AT": "split:3", "CLEAVE_WORKER_FAULT_DIR": str(tmp_path / "f")})
        fleet.add_worker()
        fleet.start_ps(job, tmp_path / "m.jsonl")
        with pytest.raises(Exception, match="exited with 4"):
            fleet.wait_ps(tmp_path / "m.jsonl", timeout_s=120)
        log = (tmp_path / "run" / "logs" / "ps.log").read_text()
        assert "split_client_lost" in log and "a-victim" in log
        assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3  # steps 0-2 stand, nothing half-done
    finally:
        fleet.stop()
