"""`cleave train --nats <list>` on a cluster someone else runs (what `cleave up --nats-cluster 3` prints):
a 3-node cluster with its scheduler and workers, a tiny job trained against the comma-separated server
list, the nats-server holding the PS's connection SIGKILLed mid-job and left down; the job finishes, its
losses equal `--reference`, and the PS restarted at most once (a JetStream call that timed out while the
cluster re-elected the dead node's stream leaders). And the re-watch after a reconnect that the PS's plan
watch needs there: retried until the bucket answers, not raised."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from cleave import bus as busmod
from cleave.api.fleet import LocalFleet, MetricsTail, run_reference
from tests.integration.fleet import assert_same
from tests.integration.test_nats_cluster import job_of, node_of

STEPS = 8
KILL_AFTER_STEP = 1
JOB_TIMEOUT_S = 240.0


@pytest.mark.slow  # 70-90 s here under load: a reference run, a cluster, 8 steps and a fail-over
def test_cleave_train_on_a_cluster_survives_a_dead_node(tmp_path):
    job = job_of(STEPS, "train-on-cluster")
    want = [m["loss"] for m in run_reference(job, tmp_path / "ref.jsonl")]
    (tmp_path / "job.json").write_text(job.model_dump_json())
    cluster = LocalFleet(tmp_path / "cluster", 3, nats_cluster=3)  # as `cleave up --nats-cluster 3 --workers 3`
    metrics, out = tmp_path / "run.jsonl", tmp_path / "train.out"
    try:
        cluster.start()
        cluster.wait_joined()
        with out.open("w") as console:
            lines, killed_at = train_killing_a_node(cluster, tmp_path, metrics, console)
    finally:
        cluster.stop()
    assert killed_at < STEPS, "the node died after the job"
    assert "nats_reconnected" in (tmp_path / "train" / "logs" / "ps.log").read_text()  # it did fail over
    ps = {p["name"]: p for p in json.loads((tmp_path / "train" / "stack.json").read_text())["processes"]}["ps"]
    # while the cluster re-elects the leaders the dead node held (seconds), a JetStream call of the PS in
    # flight (its commit, its plan watch) may time out: the PS exits, `cleave train` restarts it and it
    # resumes from its last commit. Once, not in a loop.
    assert ps["restarts"] <= 1, "the PS kept crashing on the lost node: see train/logs/ps.log"
    got = {m["step"]: m["loss"] for m in lines}  # a step redone after a fail-over is written again
    assert sorted(got) == list(range(STEPS)), out.read_text()[-3000:]
    assert_same([got[s] for s in range(STEPS)], want)


def train_killing_a_node(cluster: LocalFleet, tmp_path, metrics, console) -> tuple[list[dict], int]:
    """`cleave train --nats <the list>`; once step KILL_AFTER_STEP is reported, SIGKILL the nats-server
    holding the PS's connection and leave it down (nobody runs the cluster's supervisor). Returns the
    metrics lines and how many had been written when the node died."""
    train = subprocess.Popen([sys.executable, "-m", "cleave_cli", "train", "--config", str(tmp_path / "job.json"),
                              "--nats", cluster.stack.nats_url, "--metrics-out", str(metrics),
                              "--run-dir", str(tmp_path / "train")], stdout=console, stderr=subprocess.STDOUT,
                             # a commit (and its metrics line) after every step: the node dies mid-job however
                             # long the first commit took (else a loaded machine may batch steps 1-7 into one)
                             env={**os.environ, "CLEAVE_PS_PERSIST_EVERY": "1"})
    try:
        victim = node_of(cluster, "cleave-ps-")  # the PS's own server (it connects before step 0)
        tail, lines, killed_at = MetricsTail(metrics), [], None
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while train.poll() is None and time.monotonic() < deadline:
            lines += tail.read()
            if killed_at is None and any(m["step"] >= KILL_AFTER_STEP for m in lines):
                cluster.stack.kill(victim)
                killed_at = len(lines)
            time.sleep(0.2)
    finally:
        if train.poll() is None:
            train.kill()
        train.wait(timeout=30)
    assert train.returncode == 0, f"cleave train exited with {train.returncode}"
    assert killed_at is not None and cluster.stack.procs[victim].restarts == 0
    return lines + tail.read(), killed_at


async def test_a_watch_set_up_again_after_a_reconnect_retries_until_the_bucket_answers(nats_url):
    """`Bus.watch` re-subscribes after every reconnect; where that fails (here the bucket is gone, on a
    cluster its stream may still be electing a leader) it retries until it works instead of raising out of
    the service's task group."""
    bus = await busmod.connect(nats_url, "probe")
    try:
        kv, stop = await bus.kv("rewatch"), asyncio.Event()
        await bus.js.delete_key_value("rewatch")
        task = asyncio.create_task(bus._rewatch(kv, "rewatch", "k", stop))
        deadline = time.monotonic() + 30
        while not bus.watch_retries:  # until it failed once (counted: structlog's capture misses cached loggers)
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        kv = await bus.kv("rewatch")  # the bucket is back
        await kv.put("k", b"after")
        watcher = await asyncio.wait_for(task, 30)
        entry = await watcher.updates(timeout=10)
        if entry is None:  # the watch began before the put: the end of its (empty) initial values comes first
            entry = await watcher.updates(timeout=10)
        assert entry.value == b"after"
        await watcher.stop()
        await bus.js.delete_key_value("rewatch")  # gone again: a retrying re-watch ends when told to stop
        task = asyncio.create_task(bus._rewatch(kv, "rewatch", "k", stop))
        stop.set()
        assert await asyncio.wait_for(task, 30) is None
    finally:
        await bus.close()
