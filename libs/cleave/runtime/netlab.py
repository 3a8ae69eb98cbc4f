"""A shaped-link lab: Linux network namespaces joined by veth pairs, each edge link shaped by `tbf`.

One hub namespace (where nats-server, the scheduler and the PS run) and one namespace per edge device,
each joined to the hub by its own veth pair on its own subnet (hub 10.77.<i>.1, device 10.77.<i>.2). A
link's downlink (hub -> device) is a `tbf` on the hub end, its uplink (device -> hub) a `tbf` on the
device end; a link with no rates is left unshaped. `cut` takes the device end down (packets in both
directions are dropped, established TCP connections stay open and back off, as on a dead radio link) and
`restore` brings it back with its shaping. A link with `cpu` set gives its device a share of the machine's
cores too: everything run in its namespace (`wrap`) runs in a cgroup of its own whose CFS quota is `cpu`
cores every CPU_PERIOD_US, so the emulated devices of one machine do not take each other's compute (each
measures its FLOPS, and computes its tiles, within its own share). Needs cgroup v1's cpu controller.

Every name starts with a prefix unique to the run (`cl` + 6 hex digits), so two labs never collide, and
every interface and address lives inside the lab's own namespaces: nothing is added to the root namespace.
`Netlab` is a context manager; leaving it (also on an error half-way through `create`) deletes the
namespaces, which removes their veth pairs, after killing whatever still runs inside them. Needs root
(CAP_NET_ADMIN and CAP_SYS_ADMIN); `unavailable()` says why a lab cannot be made here.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from cleave.errors import ConfigError, NetlabError

HUB_PORT = 4222  # nats-server's client port inside the hub namespace
DEFAULT_QUEUE_S = 0.05  # tbf queue: at most this many seconds of a link's bytes wait (the rest are dropped)
MIN_BURST_BYTES = 16 * 1024  # tbf bucket: at least a few MTUs (and >= rate / HZ) or it cannot reach its rate
MAX_LINKS = 250  # one /24 per link inside 10.77.0.0/16
DEFAULT_CMD_TIMEOUT_S = 10.0
CGROUP_CPU = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller: one child per device with a share
CPU_PERIOD_US = 10_000  # a share is enforced every 10 ms: a worker's FLOPS probe (a few ms) spans periods
MIN_QUOTA_US = 1_000  # the kernel's smallest quota: shares start at 0.1 core



@dataclass(frozen=True)
class Link:
    """One edge device's link to the hub; None rates leave that direction unshaped (bytes per second)."""

    id: str
    down: float | None = None
    up: float | None = None
    cpu: float | None = None  # cores its device may use (a CFS quota); None = no limit of its own


def load_links(path: str | Path) -> list[Link]:
    """Links from a fleet file: a JSON list of {"id", "downlink_bytes_per_s"?, "uplink_bytes_per_s"?, ...}
    (the fleet-file form of `cleave.plan.fleet`; other fields are ignored, a missing rate means unshaped)."""
    try:
        raw = json.loads(Path(path).read_text())
        links = [Link(str(e["id"]), e.get("downlink_bytes_per_s"), e.get("uplink_bytes_per_s"), e.get("cpu_cores"))
                 for e in raw]
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"fleet file {path}: {e!r}") from None
    for link in links:
        for rate in (link.down, link.up):
            if rate is not None and not (isinstance(rate, int | float) and rate > 0):
                raise ConfigError(f"fleet file {path}: link {link.id!r} has rate {rate!r}, expected bytes/s > 0")
        if link.cpu is not None and not (isinstance(link.cpu, int | float) and link.cpu * CPU_PERIOD_US >= MIN_QUOTA_US):
            raise ConfigError(f"fleet file {path}: link {link.id!r} has cpu_cores {link.cpu!r}, expected >= "
                              f"{MIN_QUOTA_US / CPU_PERIOD_US}")
    return links


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one `ip`/`tc` command; a failure raises NetlabError with its stderr."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=DEFAULT_CMD_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetlabError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """Why no lab can be made on this machine (None when a namespace can be created and deleted)."""
    name = f"cl{secrets.token_hex(3)}-check"
    try:
        done = sh("ip", "netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot run ip: {e!r}"
    if done.returncode != 0:
        return f"cannot create a network namespace (needs root): {done.stderr.strip()}"
    sh("ip", "netns", "del", name, check=False)
    return None


def cpu_unavailable() -> str | None:
    """Why links cannot have a CPU share here (None when they can)."""
    quota = CGROUP_CPU / "cpu.cfs_quota_us"
    if not quota.exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU} (cgroup v2 is not supported yet)"
    if not os.access(CGROUP_CPU, os.W_OK):
        return f"cannot create a cgroup under {CGROUP_CPU} (needs root)"
    return None


def tbf(dev: str, rate: float) -> list[str]:
    """The tc arguments that shape `dev`'s egress to `rate` bytes/s with a DEFAULT_QUEUE_S queue."""
    burst = max(MIN_BURST_BYTES, int(rate / 100))
    limit = max(2 * burst, int(rate * DEFAULT_QUEUE_S))
    return ["qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate * 8)}bit", "burst", str(burst),
            "limit", str(limit)]


@dataclass
class Netlab:
    """The namespaces and links of one lab. `hub` is the hub namespace; `ns(id)` a device's."""

    links: list[Link]
    prefix: str = field(default_factory=lambda: f"cl{secrets.token_hex(3)}")
    created: list[str] = field(default_factory=list)  # namespaces, in creation order
    cgroups: dict[str, Path] = field(default_factory=dict)  # device namespace -> its CPU share's cgroup

    def __post_init__(self) -> None:
        ids = [link.id for link in self.links]
        if len(set(ids)) != len(ids) or len(ids) > MAX_LINKS:
            raise ConfigError(f"a lab takes up to {MAX_LINKS} links with distinct ids, got {ids}")
        for link in self.links:
            if link.cpu is not None and not link.cpu * CPU_PERIOD_US >= MIN_QUOTA_US:
                raise ConfigError(f"link {link.id!r}: cpu {link.cpu!r} is below {MIN_QUOTA_US / CPU_PERIOD_US} core")
        self.index = {link.id: i + 1 for i, link in enumerate(self.links)}

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def ns(self, link_id: str) -> str:
        return f"{self.prefix}-w{self.index[link_id]}"

    def hub_ip(self, link_id: str) -> str:
        """The hub's address as seen from this device: what its worker dials."""
        return f"10.77.{self.index[link_id]}.1"

    def nats_url(self, link_id: str | None = None) -> str:
        """The NATS URL for a device (over its link), or for the hub itself (None)."""
        return f"nats://{'127.0.0.1' if link_id is None else self.hub_ip(link_id)}:{HUB_PORT}"

    def wrap(self, ns: str, argv: list[str]) -> list[str]:
        """`argv` run inside namespace `ns`, and in its device's CPU share if it has one (the shell joins the
        cgroup and execs ip netns exec, which execs `argv`: the pid is the program's own)."""
        inside = ["ip", "netns", "exec", ns, *argv]
        group = self.cgroups.get(ns)
        if group is None:
            return inside
        return ["sh", "-c", f'echo $$ > {group / "cgroup.procs"} && exec "$@"', "sh", *inside]

    def _devs(self, link_id: str) -> tuple[str, str]:
        i = self.index[link_id]
        return f"{self.prefix}h{i}", f"{self.prefix}e{i}"  # hub end, device end (<= 15 characters)

    def create(self) -> Netlab:
        try:
            self._add_ns(self.hub)
            for link in self.links:
                self._add_link(link)
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.created.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _add_link(self, link: Link) -> None:
        ns, (hub_dev, dev) = self.ns(link.id), self._devs(link.id)
        self._add_ns(ns)
        sh("ip", "link", "add", hub_dev, "netns", self.hub, "type", "veth", "peer", "name", dev, "netns", ns)
        i = self.index[link.id]
        sh("ip", "-n", self.hub, "addr", "add", f"10.77.{i}.1/24", "dev", hub_dev)
        sh("ip", "-n", ns, "addr", "add", f"10.77.{i}.2/24", "dev", dev)
        for name, d in ((self.hub, hub_dev), (ns, dev)):
            sh("ip", "-n", name, "link", "set", d, "up")
        self.shape(link)
        if link.cpu is not None:
            self._add_share(ns, link.cpu)

    def _add_share(self, ns: str, cores: float) -> None:
        why = cpu_unavailable()
        if why:
            raise NetlabError(f"a CPU share for {ns}: {why}")
        group = CGROUP_CPU / ns
        group.mkdir()
        self.cgroups[ns] = group
        (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (group / "cpu.cfs_quota_us").write_text(str(int(cores * CPU_PERIOD_US)))

    def throttled(self, link_id: str) -> int:
        """How many periods its device's processes were stopped by their CPU share so far (cpu.stat)."""
        stat = (self.cgroups[self.ns(link_id)] / "cpu.stat").read_text().split()
        return int(stat[stat.index("nr_throttled") + 1])

    def shape(self, link: Link) -> None:
        """(Re)apply a link's rates: downlink on the hub end's egress, uplink on the device end's."""
        hub_dev, dev = self._devs(link.id)
        for ns, d, rate in ((self.hub, hub_dev, link.down), (self.ns(link.id), dev, link.up)):
            if rate is not None:
                sh("ip", "netns", "exec", ns, "tc", *tbf(d, rate))
            else:
                sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", d, "root", check=False)

    def cut(self, link_id: str) -> None:
        """The link goes dead: its device end is taken down (nothing passes either way)."""
        sh("ip", "-n", self.ns(link_id), "link", "set", self._devs(link_id)[1], "down")

    def restore(self, link_id: str) -> None:
        """The link comes back with its address, route and shaping (qdiscs outlive a down/up)."""
        sh("ip", "-n", self.ns(link_id), "link", "set", self._devs(link_id)[1], "up")

    def qdisc(self, link_id: str) -> tuple[str, str]:
        """`tc qdisc show` of the hub end and the device end (for checks and reports)."""
        hub_dev, dev = self._devs(link_id)
        return (sh("ip", "netns", "exec", self.hub, "tc", "qdisc", "show", "dev", hub_dev).stdout,
                sh("ip", "netns", "exec", self.ns(link_id), "tc", "qdisc", "show", "dev", dev).stdout)

    def teardown(self) -> None:
        """Kill what runs in the lab's namespaces (only processes started inside them), delete them."""
        for name in reversed(self.created):
            pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", name, check=False)
        self.created.clear()
        for group in self.cgroups.values():  # empty once its processes (all in its namespace) are gone
            deadline = time.monotonic() + DEFAULT_CMD_TIMEOUT_S
            while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
                time.sleep(0.01)  # SIGKILLed above: waiting for the kernel to reap them
            with contextlib.suppress(OSError):
                group.rmdir()
        self.cgroups.clear()

    def __enter__(self) -> Netlab:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.teardown()
