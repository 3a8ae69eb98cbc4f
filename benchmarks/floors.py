"""What a step cannot beat on this machine, measured in the same run as the step (benchmarks/step.py).

- `bus_rate_measure`: the best aggregate rate of core NATS on loopback to N concurrent subscribers at one message
  size, from N publishers (N publisher/subscriber pairs, each a process of its own) or from one publisher
  process (as the PS publishes); the tiles and the fan-out blocks both travel as core NATS messages of at
  most the server's max_payload.
- `bus_mix_seconds`: the seconds core NATS takes for a PS's traffic in both directions at once, from one hub
  process to N spoke processes and back, each over one connection, as the PS and its workers are connected.
  The clients of both are bare nats-py clients (a loop of `publish` calls, a callback counting messages) with the
  receive path the PS and the workers have (`cleave.bus.receive`), so the floor is not slowed down by nats-py's
  own parser.
- `gemm_seconds`: one step's GEMMs at their own shapes with all of torch's threads.
- `CpuSampler`: where a process's CPU goes, by sampling every thread's Python stack (`sys._current_frames`)
  and sorting each busy sample into serialisation, copies, bus, local compute or Python; the measured CPU
  seconds (`time.process_time`) are split in those proportions.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from cleave import bus as busmod
from cleave.models import gemm_shapes

DEFAULT_WINDOW = 32  # messages in flight per pair, as the PS's window of tiles per worker
DEFAULT_WINDOW_BYTES = 32 << 20  # and at most these bytes: below the server's max_pending for a subscriber
# (cleave.bus.limits.SERVER_MAX_PENDING), past which it cuts the subscriber off as a slow consumer
DEFAULT_PAIR_BYTES = 48 << 20  # what each pair moves per measurement
DEFAULT_SAMPLE_S = 0.005
CATEGORIES = ("serialisation", "copies", "bus", "local_compute", "python")

# A client process: it publishes `count` messages of `size` to each of its `out` subjects, at most `window`
# unacknowledged on each (acknowledgements come on the subject's ".ack"), while it counts `in_count` messages on
# each of its `into` subjects and acknowledges every `every`; then reports its CPU seconds on bench.done.
# A publisher has only `out`; the PS's topology both ways (`bus_mix_seconds`) is one hub (as the PS: one
# process, one connection) with an out and an into subject per spoke (as a worker), and spokes the other way.
NODE = """
import asyncio, sys, time
from cleave.bus.receive import client
async def main(url, tag, out, size, count, window, into, in_count, every):
    nc = client()  # the receive path the PS and workers have (cleave.bus.receive)
    await nc.connect(url)
    out, into = [s for s in out.split(",") if s], [s for s in into.split(",") if s]
    acked, got, moved = dict.fromkeys(out, 0), dict.fromkeys(into, 0), asyncio.Event()
    def on_ack(s):
        async def cb(msg):
            acked[s] = int(msg.data)
            moved.set()
        return cb
    def on_msg(s):
        async def cb(msg):
            got[s] += 1
            if got[s] % every == 0 or got[s] == in_count:
                await nc.publish(s + ".ack", str(got[s]).encode())
            moved.set()
        return cb
    for s in out:
        await nc.subscribe(s + ".ack", cb=on_ack(s))
    for s in into:
        await nc.subscribe(s, cb=on_msg(s), pending_bytes_limit=1 << 30, pending_msgs_limit=1_000_000)
    go = await nc.subscribe("bench.go")
    await nc.publish("bench.ready", b"")
    await nc.flush()
    await go.next_msg(timeout=120)
    cpu = time.process_time()
    payload = bytes(size)
    for n in range(count):
        for s in out:
            while n - acked[s] >= window:
                moved.clear()
                await asyncio.wait_for(moved.wait(), 60)
            await nc.publish(s, payload)
    while min(acked.values(), default=count) < count or min(got.values(), default=in_count) < in_count:
        moved.clear()
        await asyncio.wait_for(moved.wait(), 60)
    await nc.publish("bench.done", f"{tag} {time.process_time() - cpu}".encode())  # its CPU seconds
    await nc.flush()
    await nc.close()
asyncio.run(main(*sys.argv[1:4], *map(int, sys.argv[4:7]), sys.argv[7], *map(int, sys.argv[8:])))
"""



CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux: from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_cpu() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, summed over its cores, every process's (other
    tenants' too) (Linux: /proc/stat)."""
    ticks = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = ticks[3] + ticks[4]  # idle, iowait (the others: user, nice, system, irq, softirq, steal)
    return (sum(ticks) - idle) / CLOCK_TICKS, sum(ticks) / CLOCK_TICKS


def node(url: str, tag: str, out: Sequence[str], size: int, count: int, in_flight: int, into: Sequence[str] = (),
         in_count: int = 0, ack_every: int = 1) -> list[str]:
    """The command line of a NODE process."""
    return [sys.executable, "-c", NODE, url, tag, ",".join(out), str(size), str(count), str(in_flight),
            ",".join(into), str(in_count), str(ack_every)]


SUBSCRIBER = """
import asyncio, sys, time
from cleave.bus.receive import client
async def main(url, subject, count, every):
    nc = client()  # the receive path the PS and workers have (cleave.bus.receive)
    await nc.connect(url)
    got, done, cpu = 0, asyncio.Event(), 0.0
    async def on_msg(msg):
        nonlocal got, cpu
        if not got:
            cpu = time.process_time()
        got += 1
        if got % every == 0 or got == count:
            await nc.publish(subject + ".ack", str(got).encode())
        if got == count:
            done.set()
    await nc.subscribe(subject, cb=on_msg, pending_bytes_limit=1 << 30, pending_msgs_limit=1_000_000)
    await nc.publish("bench.ready", b"")
    await nc.flush()
    await asyncio.wait_for(done.wait(), 300)
    await nc.publish("bench.cpu", str(time.process_time() - cpu).encode())  # its CPU seconds from the first message
    await nc.flush()
    await nc.close()
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


async def _gather(sub, n: int, timeout_s: float) -> None:  # noqa: ANN001
    for _ in range(n):
        await sub.next_msg(timeout=timeout_s)


def window(size: int, streams: int = 1) -> int:
    """Messages in flight per stream of `size`-byte messages, when `streams` of them flow into one connection:
    DEFAULT_WINDOW, or fewer so that they stay under DEFAULT_WINDOW_BYTES."""
    return max(1, min(DEFAULT_WINDOW, DEFAULT_WINDOW_BYTES // (size * streams)))


def every(in_flight: int) -> int:
    """How often a receiver acknowledges: every 8 messages, or more often in a small window."""
    return max(1, min(8, in_flight // 4))


async def bus_measure(url: str, pairs: int, size: int, one_publisher: bool = False,
                      pair_bytes: int = DEFAULT_PAIR_BYTES) -> dict[str, float]:
    """Bytes/s moved to `pairs` subscriber processes at once, each on its own subject, from as many publisher
    processes or (`one_publisher`) from one, as the PS publishes to its workers (`bytes_per_s`); the CPU
    seconds of the publisher and subscriber processes (nats-py clients) per byte moved,
    `publisher_ns_per_byte` and `subscriber_ns_per_byte`; and the whole machine's busy CPU seconds per byte
    while they moved (`machine_cpu`: nats-server's and the clients', and whatever else ran),
    `machine_ns_per_byte`."""
    in_flight = window(size)
    count = max(in_flight * 2, pair_bytes // size)
    subjects = [f"bench.p{i}" for i in range(pairs)]
    senders = [",".join(subjects)] if one_publisher else subjects
    bus = await busmod.connect(url, "bench-bus")
    ready, done = await bus.nc.subscribe("bench.ready"), await bus.nc.subscribe("bench.done")
    cpus = await bus.nc.subscribe("bench.cpu")
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", SUBSCRIBER, url, s, str(count),
                                                  str(every(in_flight)))
             for s in subjects]
    try:
        await _gather(ready, pairs, 60)
        procs += [await asyncio.create_subprocess_exec(*node(url, "publisher", s.split(","), size, count, in_flight))
                  for s in senders]
        await _gather(ready, len(senders), 60)
        t0, busy0 = time.perf_counter(), machine_cpu()[0]
        await bus.nc.publish("bench.go", b"")
        pub_s = [float((await done.next_msg(timeout=300)).data.split()[1]) for _ in senders]
        moved = pairs * count * size
        rate, busy = moved / (time.perf_counter() - t0), machine_cpu()[0] - busy0
        sub_s = [float((await cpus.next_msg(timeout=60)).data) for _ in subjects]
        for p in procs:
            await p.wait()
        return {"bytes_per_s": rate, "publisher_ns_per_byte": 1e9 * sum(pub_s) / moved,
                "subscriber_ns_per_byte": 1e9 * sum(sub_s) / moved, "machine_ns_per_byte": 1e9 * busy / moved}
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
        await bus.close()


async def bus_mix_seconds(url: str, spokes: int, size_down: int, bytes_down: int, size_up: int,
                          bytes_up: int) -> dict[str, float]:
    """The seconds nats-server and bare nats-py clients take to move `bytes_down` from one hub process to
    `spokes` processes (as much to each, in messages of `size_down`) while the spokes move `bytes_up` back (in
    messages of `size_up`): the PS's traffic of a GEMM, both directions at once over the same connections,
    with the hub's CPU seconds (`hub_cpu_s`) and the spokes' together (`spokes_cpu_s`)."""
    count = max(1, round(bytes_down / size_down / spokes))
    up_count = max(1, round(bytes_up / size_up / spokes))
    every_down, every_up = every(window(size_down)), every(window(size_up, spokes))
    bus = await busmod.connect(url, "bench-bus")
    ready, done = await bus.nc.subscribe("bench.ready"), await bus.nc.subscribe("bench.done")
    down, up = [f"mix.d{i}" for i in range(spokes)], [f"mix.u{i}" for i in range(spokes)]
    procs = [await asyncio.create_subprocess_exec(*node(url, "spoke", [up[i]], size_up, up_count, window(size_up, spokes),
                                                        [down[i]], count, every_down)) for i in range(spokes)]
    try:
        await _gather(ready, spokes, 60)
        procs.append(await asyncio.create_subprocess_exec(*node(url, "hub", down, size_down, count, window(size_down),
                                                                up, up_count, every_up)))
        await _gather(ready, 1, 60)
        t0 = time.perf_counter()
        await bus.nc.publish("bench.go", b"")
        cpus = [(await done.next_msg(timeout=300)).data for _ in procs]
        seconds = time.perf_counter() - t0
        for p in procs:
            await p.wait()
        scale = (bytes_down + bytes_up) / (spokes * (count * size_down + up_count * size_up))
        return {"seconds": seconds * scale,
                "hub_cpu_s": next(float(c.split()[1]) for c in cpus if c.startswith(b"hub ")),
                "spokes_cpu_s": sum(float(c.split()[1]) for c in cpus if c.startswith(b"spoke "))}
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
        await bus.close()


async def bus_best(url: str, pairs: int, size: int, one_publisher: bool, tries: int = 2) -> dict[str, float]:
    """The fastest of `tries` measurements (`bus_measure`) of one topology."""
    return max([await bus_measure(url, pairs, size, one_publisher) for _ in range(tries)],
               key=lambda r: r["bytes_per_s"])


async def bus_rate_measure(url: str, pairs: int, size: int, tries: int = 2) -> dict[str, float]:
    """The fastest of `tries` measurements each with `pairs` publishers and with one publisher (`bus_measure`)."""
    return max([await bus_best(url, pairs, size, one, tries) for one in (False, True)], key=lambda r: r["bytes_per_s"])


def gemm_seconds(preset_cfg, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> tuple[float, float]:  # noqa: ANN001
    """(FLOPs of one step's GEMMs, the best seconds this process takes for them with all threads)."""
    flops, seconds = 0, 0.0
    for g in gemm_shapes(preset_cfg, batch, seq):
        a, bt = torch.randn(g.m, g.k, dtype=dtype), torch.randn(g.n, g.k, dtype=dtype)
        a @ bt.T  # warm-up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            a @ bt.T
            best = min(best, time.perf_counter() - t0)
        seconds += best * g.count_per_step
        flops += g.flops * g.count_per_step
    return flops, seconds


# ---- where the CPU goes -----------------------------------------------------------------------------
IDLE = {("selectors.py", "select"), ("threading.py", "wait"), ("threading.py", "_wait_for_tstate_lock"),
        ("thread.py", "_worker"), ("queue.py", "get")}
SERIAL = ("/msgpack/", "/pydantic", "/zstandard", "cleave/schemas/")
COMPUTE = ("/torch/", "cleave/models/", "cleave/train/trainer.py", "cleave/gemm/tiled.py", "cleave/train/schedule.py",
           "cleave/train/precision.py")


def classify(frame) -> str | None:  # noqa: ANN001
    """A thread's innermost frame -> its category, or None when it waits."""
    code = frame.f_code
    if (code.co_filename.rsplit("/", 1)[-1], code.co_name) in IDLE:
        return None
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if path.endswith("cleave/codec.py"):
            return "copies" if name in ("tensor_to_data", "data_to_tensor") else "serialisation"
        if any(s in path for s in SERIAL):
            return "serialisation"
        if "/nats/" in path or "cleave/bus/" in path:
            return "bus"
        if path.endswith("cleave_ps/fleet/dispatcher.py") and name == "<lambda>":  # casts, checks, assembly
            return "copies"
        if path.endswith("cleave_ps/main.py") and name == "gemm":  # FleetGemm's host copies
            return "copies"
        if any(s in path for s in COMPUTE):
            return "local_compute"
        frame = frame.f_back
    return "python"


class CpuSampler:
    """Samples every thread but its own; `between(t0, t1)` splits the CPU seconds of that window."""

    def __init__(self, interval_s: float = DEFAULT_SAMPLE_S) -> None:
        self.interval_s = interval_s
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.kinds: list[Counter] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            kinds = Counter(classify(f) for t, f in sys._current_frames().items() if t != me)
            kinds.pop(None, None)
            self.times.append(time.time())
            self.cpu.append(time.process_time())
            self.kinds.append(kinds)

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds in [t0, t1] and their split by category."""
        i, j = bisect.bisect_left(self.times, t0), bisect.bisect_right(self.times, t1) - 1
        if j <= i:
            return {"cpu_s": 0.0, **dict.fromkeys(CATEGORIES, 0.0)}
        total = Counter()
        for k in self.kinds[i : j + 1]:
            total.update(k)
        cpu, n = self.cpu[j] - self.cpu[i], max(1, sum(total.values()))
        return {"cpu_s": cpu, **{c: cpu * total[c] / n for c in CATEGORIES}}
