"""The preflight: the PS's memory estimate, and a job that cannot fit refused naming the knob."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from cleave.errors import ConfigError
from cleave.train import preflight
from cleave.train.job import JobConfig


def test_the_estimate_counts_four_copies_of_the_weights_and_activations_grow_with_the_batch() -> None:
    one = preflight.estimate(JobConfig(preset="small", batch_size=1, seq_len=64), workers=2)
    four = preflight.estimate(JobConfig(preset="small", batch_size=4, seq_len=64), workers=2)
    assert one.weights == one.grads == 4 * one.params and one.optimizer == 8 * one.params
    assert 3.5 < four.activations / one.activations < 4.5
    assert four.total > one.total > one.weights * 4
    assert preflight.estimate(JobConfig(preset="small", batch_size=1, seq_len=64), workers=8).largest_tile[-1] \
        < one.largest_tile[-1]  # more workers, smaller tiles


@pytest.mark.parametrize(("memory", "knob"), [(0.6e9, "lower batch_size .now 64. or seq_len"),
                                              (0.2e9, "choose a smaller model .preset.")])
def test_a_job_that_cannot_fit_is_refused_naming_the_knob(memory: float, knob: str) -> None:
    job = JobConfig(preset="small", batch_size=64)
    est = preflight.estimate(job, workers=2)
    assert est.total > 0.6e9 and est.weights * 4 + est.runtime < 0.6e9
    with pytest.raises(ConfigError, match=f"needs about .* GB on the PS .* are available; to fit, .*{knob}"):
        preflight.check(job, est, int(memory))
    preflight.check(job, est, est.total + 1)  # fits: nothing raised


def test_train_dry_run_prints_the_estimate_and_refuses_what_cannot_fit(tmp_path) -> None:
    def dry(memory: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "cleave_cli", "train", "--preset", "small", "--batch-size", "64",
             "--dry-run", "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=120,
            env={**os.environ, "CLEAVE_PS_MEMORY_BYTES": str(memory)})

    ok = dry(5 * 10**8)  # fits once fewer weight gradients are deferred beside the backward than 8
    assert ok.returncode == 0 and "PS peak" in ok.stdout and "activations" in ok.stdout and "fits" in ok.stdout
    assert re.search(r"and [0-7] deferred dW's", ok.stdout), ok.stdout
    assert re.search(r"free outputs +0\.\d\d GB", ok.stdout), ok.stdout  # what the job leaves of 0.27 GB
    assert "workers      4, memory_bytes 512.00 MiB (a local stack's workers)" in ok.stdout  # (its 4, not 1)
    assert "0.50 GB  (the PS's memory_bytes setting, CLEAVE_PS_MEMORY_BYTES)" in ok.stdout  # (not "host memory")
    refused = dry(4 * 10**8)
    assert refused.returncode == 2 and "lower batch_size (now 64)" in refused.stderr, refused.stderr


def test_a_ps_that_cannot_fit_is_refused_before_it_dials_nats() -> None:
    """Nothing answers at the PS's NATS address: the refusal comes at once all the same (it used to wait for
    the bus, retrying, before its preflight ran)."""
    from cleave.api.natsconf import free_port  # noqa: PLC0415

    env = {k: v for k, v in os.environ.items() if not k.startswith("CLEAVE_")}
    refused = subprocess.run([sys.executable, "-m", "cleave_cli", "ps", "--nats", f"nats://127.0.0.1:{free_port()}"],
                             capture_output=True, text=True, timeout=60, env={**env, "CLEAVE_PS_MEMORY_BYTES": "1000"})
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert re.search(r"cleave: error: job 'job-[0-9-]+-[0-9a-f]{4}' needs about 0\.\d+ GB on the PS .* but 0\.00 GB are available",
                     refused.stderr), refused.stderr[-2000:]
    assert "nats" not in refused.stderr.lower()  # (no connection tried, nothing retried)


def test_recomputation_and_micro_batches_shrink_what_a_forward_keeps() -> None:
    plain = preflight.estimate(JobConfig(preset="small", batch_size=8, seq_len=128, recompute=False), workers=2)
    again = preflight.estimate(JobConfig(preset="small", batch_size=8, seq_len=128, recompute=True), workers=2)
    micro = preflight.estimate(JobConfig(preset="small", batch_size=8, seq_len=128, micro_batches=4), workers=2)
    acts = preflight.activations(JobConfig(preset="small", batch_size=8, seq_len=128), plain.layout)
    assert again.activations == acts.outside + 4 * acts.block_input + acts.block < plain.activations
    assert acts.block_input == 8 * 128 * 128 * 4  # a block keeps its float32 input (B, T, C)
    assert 3.5 < plain.activations / micro.activations < 4.5
    fwd = "the end of a forward"  # micro-batches after the first hold the earlier ones' gradients
    assert micro.phases[fwd][0] == micro.grads + micro.activations + micro.head
    assert plain.phases[fwd][0] == plain.activations + plain.head


def test_recompute_is_turned_on_only_when_the_job_does_not_fit_without_it() -> None:
    job = JobConfig(preset="small", batch_size=64)
    plain = preflight.estimate(job.model_copy(update={"recompute": False}), workers=2)
    again = preflight.estimate(job.model_copy(update={"recompute": True}), workers=2)
    assert again.total < plain.total
    roomy, est = preflight.resolve(job, preflight.Memory(plain.total), workers=2)
    assert roomy.recompute is False and est == plain
    tight, est = preflight.resolve(job, preflight.Memory(plain.total - 1), workers=2)
    assert tight.recompute is True and est == again
    pool = 256 << 20  # the PS's freed outputs take only the room the job leaves, and change no decision
    roomy, est = preflight.resolve(job, preflight.Memory(plain.total + pool), workers=2, pool=pool)
    assert roomy.recompute is False and est == dataclasses.replace(plain, pool=pool)
    snug, est = preflight.resolve(job, preflight.Memory(plain.total + 1000), workers=2, pool=pool)
    assert snug.recompute is False and est == dataclasses.replace(plain, pool=1000)
    tight, est = preflight.resolve(job, preflight.Memory(plain.total - 1), workers=2, pool=pool)
    assert tight.recompute is True and est.total <= plain.total - 1 and est == dataclasses.replace(again, pool=est.pool)
    assert preflight.estimate(JobConfig(preset="tiny", batch_size=1), workers=2, pool=pool).pool == 0  # outputs < 1 MiB
    mine, _ = preflight.resolve(job.model_copy(update={"recompute": False}), preflight.Memory(1), workers=2)
    assert mine.recompute is False  # what the job says is kept (and refused by check if it cannot fit)
    with pytest.raises(ConfigError, match="set recompute=true"):
        preflight.check(mine, plain, again.total)


def test_a_gpu_ps_is_checked_against_the_gpus_free_memory_and_the_host_for_the_rest() -> None:
    job = JobConfig(preset="small", batch_size=8)
    est = preflight.estimate(job, workers=2)
    preflight.check(job, est, preflight.Memory(host=est.host_bytes, gpu=est.model_bytes, gpu_name="GPU 0"))
    with pytest.raises(ConfigError, match=r"on its GPU \(GPU 0\) .* but .* GB are available"):
        preflight.check(job, est, preflight.Memory(host=10**12, gpu=est.model_bytes - 1, gpu_name="GPU 0"))
    with pytest.raises(ConfigError, match="on the PS"):
        preflight.check(job, est, preflight.Memory(host=est.host_bytes - 1, gpu=10**12, gpu_name="GPU 0"))
    assert preflight.ps_memory(job.model_copy(update={"device": "cpu"})).gpu is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_a_gpu_ps_reads_the_gpus_free_memory() -> None:
    memory = preflight.ps_memory(JobConfig(preset="tiny", device="cuda"))
    free, total = torch.cuda.mem_get_info()
    assert 0 < memory.gpu <= total and abs(memory.gpu - free) < 0.05 * total and memory.gpu_name


def test_the_thinnest_tile_is_checked_against_the_largest_declared_budget() -> None:
    job = JobConfig(preset="small", batch_size=1, seq_len=64)
    est = preflight.estimate(job, workers=2)
    preflight.check(job, est, 10**12, [est.smallest_tile - 1, est.smallest_tile])  # one worker can hold it
    with pytest.raises(ConfigError, match="over every worker's memory_bytes"):
        preflight.check(job, est, 10**12, [est.smallest_tile - 1])


def test_the_heads_estimate_covers_what_its_chunks_hold() -> None:
    """`cleave.gemm.head` with GPT-2 Medium's head (50,257 x 1,024) over 2 chunks of 1,024 tokens, in a fresh
    process: what its peak adds to the process is the estimate within torch's and MKL's own buffers (the
    runtime's share): the running sum of dW and the largest phase, not every buffer at once."""
    code = (
        "import torch\n"
        "from torch import nn\n"
        "from cleave.gemm.head import head_loss\n"
        "head, h = nn.Linear(1024, 50257, bias=False), torch.randn(2048, 1024, requires_grad=True)\n"
        "y = torch.randint(0, 50257, (2048,))\n"
        "base = int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024\n"
        "head_loss(head, h, y, chunks=2, slices=13).backward()\n"
        "print(int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024 - base)\n")  # (not
    # ru_maxrss: a child's starts at its parent's peak, which a test run's worker can hold above this one's)
    grown = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                               check=True).stdout)
    job = JobConfig(preset="gpt2-medium", batch_size=2, seq_len=1024)
    layout = dataclasses.replace(job.layout(1), head_chunks=2, head_slices=13)
    est = preflight.head_bytes(job, layout, 2048, 4)
    # measured: 618 MB estimated, 645 to 671 MB grown alone, 802 MB in a full test run (the rest: MKL's packing
    # buffers, and freed slices the allocator keeps)
    assert 0.7 * grown <= est and grown <= est + preflight.RUNTIME_BYTES, (est, grown)


def test_a_job_held_over_by_its_deferred_gradients_is_told_to_defer_fewer() -> None:
    job = JobConfig(preset="small", batch_size=64)
    eight, none = (preflight.estimate(job, workers=2, deferred=d) for d in (8, 0))
    assert eight.deferred[0] == 8 and eight.bus - none.bus == eight.deferred[1] > 0 and none.deferred == (0, 0)
    fwd, start = eight.phases["the end of a forward"], eight.phases["the start of the backward"]
    assert fwd == none.phases["the end of a forward"]  # only a backward defers weight gradients
    assert start == (eight.head_grad + eight.activations, eight.bus) and eight.peak_phase != "the end of a forward"
    room = none.total + (eight.total - none.total) // 2  # fits only with fewer deferred
    with pytest.raises(ConfigError, match="lower the PS's deferred_gemms .CLEAVE_PS_DEFERRED_GEMMS, now 8"):
        preflight.check(job, eight, room)
    preflight.check(job, none, room)


def test_the_preflight_defers_fewer_weight_gradients_only_as_far_as_the_job_needs() -> None:
    job = JobConfig(preset="small", batch_size=64, recompute=True)
    eight = preflight.estimate(job, workers=2, deferred=8)
    assert eight.deferring(0).total == preflight.estimate(job, workers=2, deferred=0).total
    assert preflight.resolve(job, preflight.Memory(eight.total), 2, deferred=8)[1] == eight  # fits: all 8 kept
    three = eight.deferring(3)
    assert eight.total > three.total > eight.deferring(2).total
    _, est = preflight.resolve(job, preflight.Memory(three.total), 2, deferred=8)
    assert est.deferred == three.deferred and est.total == three.total  # the most that fit
    _, est = preflight.resolve(job, preflight.Memory(eight.deferring(0).total - 1), 2, deferred=8)
    assert est.deferred[0] == 8  # nothing fits: the estimate as asked, and the refusal names the other knobs
    with pytest.raises(ConfigError, match="raise micro_batches"):
        preflight.check(job, est, eight.deferring(0).total - 1)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_trainer_holds_adamws_moments_before_its_first_step_and_steps_the_same(precision: str) -> None:
    from cleave.train.trainer import Trainer

    job = JobConfig(job_id="hold", preset="tiny", steps=3, batch_size=2, seq_len=32, precision=precision)
    lazy, held = Trainer(job), Trainer(job)
    held.hold_optimizer_state()
    moments = [t for s in held.opt.state.values() for k, t in s.items() if k != "step"]
    assert sum(t.numel() * t.element_size() for t in moments) == preflight.estimate(job, workers=2).optimizer
    assert all(not t.any() for t in moments)
    kept = held.opt.state[held.opt.param_groups[0]["params"][0]]["exp_avg"]
    held.hold_optimizer_state()  # already held (or restored from a checkpoint): kept as it is
    assert held.opt.state[held.opt.param_groups[0]["params"][0]]["exp_avg"] is kept
    assert [lazy.step(s) for s in range(3)] == [held.step(s) for s in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(lazy.model.state_dict().values(), held.model.state_dict().values(), strict=True))
    for a, b in zip(lazy.opt.state.values(), held.opt.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert held.opt.state[held.opt.param_groups[0]["params"][0]]["exp_avg"] is kept  # updated in place
