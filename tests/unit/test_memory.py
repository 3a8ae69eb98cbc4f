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
