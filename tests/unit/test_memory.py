"""A process's resident memory read from the kernel, in bytes: this process's peak by rusage and any
process's peak and size now by /proc."""

from __future__ import annotations

import subprocess
import sys

from cleave.runtime.memory import peak_rss_bytes, resident

MIB = 2**20


def test_this_process_peak_is_the_same_bytes_by_rusage_and_by_proc():
    block = bytearray(96 * MIB)  # touched: resident
    peak, now = resident()
    assert now >= 96 * MIB and peak >= now
    assert abs(peak_rss_bytes() - peak) < 8 * MIB  # one counter: KiB turned into bytes once
    del block


def test_a_process_started_by_a_larger_one_reports_its_own_peak():
    """On Linux a child's ru_maxrss starts at its parent's peak: a small PS started by a large process (a
    notebook holding a model, a benchmark after its reference) said it had peaked at its starter's size."""
    block = bytearray(1024 * MIB)
    block[::4096] = b"\1" * len(block[::4096])  # touched: resident in this process, its peak at least 1 GiB
    said = subprocess.run([sys.executable, "-c", "from cleave.runtime.memory import peak_rss_bytes; "
                           "print(peak_rss_bytes())"], capture_output=True, text=True, check=True, timeout=60)
    del block
    assert int(said.stdout) < 256 * MIB, int(said.stdout) // MIB


def test_another_process_peak_counts_what_it_touched_and_a_gone_one_reads_zero():
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(128 * 2**20); del b; print(flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()  # it has touched its 128 MiB and let them go
        peak, now = resident(child.pid)
        assert peak >= now + 100 * MIB, (peak, now)
    finally:
        child.communicate("")
    assert resident(child.pid) == (0, 0)
