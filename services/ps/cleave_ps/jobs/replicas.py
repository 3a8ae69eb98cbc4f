"""Several PS replicas of one job over torch.distributed: rendezvous, the job check, the gradient all-reduce.

Replica 0 hosts a `TCPStore` at `replica_addr:replica_port` (what MASTER_ADDR and MASTER_PORT are to
`torchrun`); the others connect to it within `replica_join_timeout_s` or exit non-zero saying so. Each
incarnation of replica 0 opens a new generation (a random key prefix), so a group that restarts never
mixes with what the previous one left in a store. Before any step every replica's job (the whole
JobConfig: model, seed, data, batch, ...) and group size are compared with replica 0's; a difference is
refused with the fields that differ. Then the replicas form a gloo group (NCCL when the PS trains on CUDA).

A step: each replica runs forward and backward on its share of the global batch (equal shares, so the mean
of the replicas' mean losses is the global batch's mean loss), then `average` waits for every replica
(a barrier: `replica_wait_s`), sums the gradients and the loss with one all-reduce (`allreduce_s`) and
divides by the group size; every replica then clips and steps the same optimizer on the same numbers.
After the step one more all-reduce of a few integers (`job_totals`) sums the replicas' workers, tiles and
bytes, so that replica 0's metrics line reports the whole job. A replica that dies makes the collective
fail in the others (`ReplicaLost`): they exit with EXIT_GROUP_LOST and the group re-forms from the last
commit (gloo cannot shrink a group in place).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from cleave.errors import ConfigError, ReplicaLost
from cleave.plan import partition
from cleave.schemas import StepMetrics

# a step's counts that the metrics line reports for the whole job, summed over the replicas (the recovery
# events themselves, gemm_s and the predictions stay replica 0's)
JOB_TOTALS = ("workers", "tiles", "tiles_resent", "tiles_copied", "tiles_dropped", "rejected", "bytes_down",
              "bytes_up", "recoveries")
GENERATION_KEY = "generation"



def job_differences(mine: dict, theirs: dict) -> list[str]:
    """'field: X here, Y at replica 0' for every field of the two fingerprints that differs."""
    keys = sorted(set(mine) | set(theirs))
    return [f"{k}: {mine.get(k)!r} here, {theirs.get(k)!r} at replica 0" for k in keys if mine.get(k) != theirs.get(k)]


def fingerprint(job_json: str, replicas: int) -> dict:
    """What must be equal on every replica of a group: the job description and the group size."""
    return {**json.loads(job_json), "ps_replicas": replicas}


@dataclass
class ReplicaGroup:
    replica: int
    replicas: int
    addr: str = "127.0.0.1"
    port: int = 29500
    join_timeout_s: float = 60.0
    step_timeout_s: float = 1800.0
    backend: str = "gloo"
    store: dist.TCPStore | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.replica < self.replicas:
            raise ConfigError(f"replica={self.replica} is outside the group of replicas={self.replicas} (0..{self.replicas - 1})")

    @property
    def where(self) -> str:
        return f"{self.addr}:{self.port}"

    # ---- rendezvous --------------------------------------------------------------------------------
    def join(self, mine: dict) -> None:
        """Reach the other replicas, check that they run this very job, form the process group (blocking)."""
        if self.backend == "nccl":  # replicas sharing a machine take its GPUs in turn ("cuda" is this one)
            torch.cuda.set_device(self.replica % torch.cuda.device_count())
        self.store = self._connect()
        gen = self._generation()
        self._check(gen, mine)
        try:
            dist.init_process_group(self.backend, store=dist.PrefixStore(f"{gen}/pg", self.store), rank=self.replica,
                                    world_size=self.replicas, timeout=timedelta(seconds=self.step_timeout_s))
        except Exception as e:
            raise ReplicaLost(f"replica {self.replica}: the process group over {self.where} did not form: {e}") from None
        if self.replica == 0:
            self.store.delete_key(GENERATION_KEY)  # late joiners wait for the next incarnation's generation

    def _connect(self) -> dist.TCPStore:
        try:
            return dist.TCPStore(self.addr, self.port, None, self.replica == 0,
                                 timeout=timedelta(seconds=self.join_timeout_s), wait_for_workers=False)
        except Exception as e:
            verb = "could not listen on" if self.replica == 0 else "could not reach replica 0 at"
            raise ReplicaLost(f"replica {self.replica} {verb} {self.where} within {self.join_timeout_s:g}s "
                              f"(replica_join_timeout_s): {type(e).__name__}: {str(e)[:300]}") from None

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, timedelta(seconds=self.join_timeout_s))
        except Exception:
            raise ReplicaLost(f"replica {self.replica}: {what} within {self.join_timeout_s:g}s "
                              f"(replica_join_timeout_s) at {self.where}") from None

    def _generation(self) -> str:
        if self.replica == 0:
            gen = secrets.token_hex(6)
            self.store.set(GENERATION_KEY, gen)
            return gen
        self._wait([GENERATION_KEY], "replica 0 opened no group")
        return self.store.get(GENERATION_KEY).decode()

    def _check(self, gen: str, mine: dict) -> None:
        """Replica 0 compares every replica's fingerprint with its own and publishes the verdict."""
        if self.store.add(f"{gen}/taken/{self.replica}", 1) > 1:
            raise ConfigError(f"replica {self.replica} of the group at {self.where} is already taken by another process")
        self.store.set(f"{gen}/fp/{self.replica}", json.dumps(mine))
        if self.replica != 0:
            self._wait([f"{gen}/fp/0"], "replica 0 did not describe its job")
            differ = job_differences(mine, json.loads(self.store.get(f"{gen}/fp/0")))
            if differ:
                raise ConfigError(f"replica {self.replica} runs a different job than replica 0: " + "; ".join(differ))
            self._wait([f"{gen}/verdict"], "replica 0 gave no verdict on the group")
            verdict = self.store.get(f"{gen}/verdict").decode()
            if verdict:
                raise ConfigError(f"replica {self.replica}: the group was refused by replica 0: {verdict}")
            return
        others = [f"{gen}/fp/{r}" for r in range(1, self.replicas)]
        self._wait(others, f"not every replica of {self.replicas} joined")
        bad = [f"replica {r}: " + "; ".join(d) for r in range(1, self.replicas)
               if (d := job_differences(json.loads(self.store.get(f"{gen}/fp/{r}")), mine))]
        self.store.set(f"{gen}/verdict", " | ".join(bad))
        if bad:
            raise ConfigError("replicas run a different job than replica 0: " + " | ".join(bad))

    # ---- steps -------------------------------------------------------------------------------------
    def share(self, t: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a global batch (B, T): an equal share each."""
        lo, hi = partition.shares(t.size(0), self.replicas)[self.replica]
        return t[lo:hi]  # (B / replicas, T)

    def average(self, model: torch.nn.Module, loss: torch.Tensor) -> tuple[float, float, float]:
        """Replace every gradient by the group's mean and return (the mean loss, wait s, all-reduce s)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([*(g.reshape(-1) for g in grads), loss.detach().reshape(1).to(grads[0].dtype)])
        try:
            t0 = time.perf_counter()
            dist.barrier()
            t1 = time.perf_counter()
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            t2 = time.perf_counter()
        except Exception as e:
            raise ReplicaLost(f"replica {self.replica}: the group broke in the all-reduce: {str(e)[:300]}") from None
        flat /= self.replicas
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        return float(flat[-1]), t1 - t0, t2 - t1

    def job_totals(self, m: StepMetrics) -> dict[str, int]:
        """The whole job's counts of a step (JOB_TOTALS: every replica's own, summed with one all-reduce of
        a few integers after the step), for replica 0's metrics line."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        t = torch.tensor([getattr(m, k) for k in JOB_TOTALS], dtype=torch.int64, device=device)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        except Exception as e:
            raise ReplicaLost(f"replica {self.replica}: the group broke summing the step's counts: {str(e)[:300]}") from None
        return dict(zip(JOB_TOTALS, t.tolist(), strict=True))

    def agree(self, value: str, what: str) -> None:
        """Every replica holds the same `value` (e.g. the step it resumes from), or ReplicaLost."""
        got: list[str | None] = [None] * self.replicas
        try:
            dist.all_gather_object(got, value)
        except Exception as e:
            raise ReplicaLost(f"replica {self.replica}: the group broke comparing {what}: {str(e)[:300]}") from None
        if len(set(got)) > 1:
            raise ReplicaLost(f"replicas disagree on {what}: {got}")

    def barrier(self) -> None:
        try:
            dist.barrier()
        except Exception as e:
            raise ReplicaLost(f"replica {self.replica}: the group broke at a barrier: {str(e)[:300]}") from None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
