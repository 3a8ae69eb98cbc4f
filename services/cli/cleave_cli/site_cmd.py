"""`cleave site`: a site of a deployment (a lab, a campus, a home): a leaf nats-server that dials the hub with
the site's credential, and N workers on it, in the foreground until Ctrl-C (supervised as `cleave up`'s).

Outbound only: the leaf node dials the hub's leaf-node port (TLS, the hub verified against the CA in the site's
folder); its workers, and those of the site's other machines (`cleave worker --nats nats://SITE:4222 --auth
DIR`), log in to it with the site's own worker credential (its folder's worker.env; the hub's client port
does not take it). A strip several of the site's workers need crosses the site's link once and is fanned out
here. A missing credential, one the hub refuses, or a hub whose certificate does not verify ends the command
with a message that says so (exit 2); a hub that is merely unreachable is waited for, up to
`--connect-timeout`, and after the first link any cut is waited out (the leaf node redials).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cleave import auth
from cleave.api import credentials as creds
from cleave.api.fleet import default_run_dir
from cleave.api.natsconf import free_port, nats_server_binary
from cleave.api.stack import Stack
from cleave.api.topology import get_json
from cleave.errors import ConfigError, Stopped
from cleave.runtime.files import write_atomic
from cleave_cli import auth_cmd, serverconf
from cleave_cli.hub import WILDCARD, split_listen

DEFAULT_SITE_PORT = 4222
DEFAULT_CONNECT_TIMEOUT_S = 60.0  # the first link to the hub; later cuts are waited out
DEFAULT_POLL_S = 0.2
REFUSED = ("authorization violation", "authentication", "permissions violation")  # the hub said no
UNVERIFIED = ("x509", "certificate", "tls: ")  # the hub's certificate did not verify
WRONG_PORT = "attempted to connect to wrong port"  # a client port (the hub's 4222) answered the leaf node
DUPLICATE = "duplicate remote leafnode connection"  # the hub holds another link with this site's credential
DUPLICATE_GRACE_S = 10.0  # a site told so this soon after its first link is the newcomer, and ends
LINK = "lid:"  # a line about the leaf node's own link ("cid:": one of its clients, whose errors are theirs)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("site", help="run a site: a leaf node dialling the hub, and workers on it")
    p.add_argument("--hub", required=True, action="append", help="the hub's leaf-node URL, tls://HOST:7422 "
                   "(repeatable: the nodes of a hub cluster)")
    p.add_argument("--name", required=True, help="the site's name, as in `cleave auth init --sites`")
    p.add_argument("--auth", type=Path, help="the site's folder from `cleave auth init` (sites/NAME, or the whole "
                   "directory); without it, CLEAVE_SITE_NATS_NKEY_SEED, CLEAVE_WORKER_NATS_NKEY_SEED and "
                   "CLEAVE_SITE_NATS_TLS_CA (its site.env, worker.env and ca.pem, as compose hands them over)")
    p.add_argument("--workers", type=int, default=2, help="workers on this machine (default 2)")
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_SITE_PORT}",
                   help="where the site's workers connect, HOST[:PORT] (0.0.0.0 for the site's other machines)")
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                   help="seconds to wait for the first link to the hub")


@dataclass
class SiteRun:
    """What a site runs: its credentials, its leaf node's addresses, its stack."""

    name: str
    hubs: tuple[str, ...]
    host: str
    port: int
    stack: Stack
    ca: Path | None = None  # the CA the hub's certificate is verified with (None: the system's)
    linked_at: float | None = None  # (monotonic) when the first link came up
    told_duplicate: bool = False

    @property
    def url(self) -> str:
        """Where this machine's workers dial the leaf node."""
        host = "127.0.0.1" if self.host in WILDCARD else self.host
        return f"nats://{host}:{self.port}"

    @property
    def log(self) -> Path:
        return self.stack.run_dir / "logs" / "nats-leaf.log"


def site_folder(folder: Path, name: str) -> Path:
    """The site's own folder: `DIR/sites/NAME` when DIR is the whole `auth init` output, else DIR."""
    inner = folder / auth_cmd.SITES_DIR / name
    return inner if inner.is_dir() else folder


def run(args: argparse.Namespace) -> int:
    from cleave.api.supervisor import stop_signals

    name = auth.check_site_name(args.name)
    site_cred, worker, ca = credentials(args.auth, name)
    if args.workers < 0:
        raise ConfigError(f"--workers must be at least 0, got {args.workers}")
    host, port = split_listen(args.listen, DEFAULT_SITE_PORT)
    run_dir = args.run_dir or default_run_dir(f"site-{name}")
    site = SiteRun(name, tuple(args.hub), host, port, Stack(run_dir), ca)
    try:
        with stop_signals():
            start_leaf(site, site_cred, worker)
            offset = wait_linked(site, args.connect_timeout)
            site.linked_at = time.monotonic()
            print(f"site {name}: leaf node {site.url} linked to {', '.join(site.hubs)}; run dir {run_dir}", flush=True)
            env = {"CLEAVE_WORKER_NATS_NKEY_SEED": worker.seed}  # (the leaf node's client port is local and plain)
            for i in range(args.workers):
                site.stack.service(f"worker-{i + 1}", "worker", ["--worker-id", f"{name}-w{i + 1}"], env=env)
            print(f"{args.workers} workers on it; other machines of the site: cleave worker --nats "
                  f"nats://<this machine>:{port} --auth <the site's folder>", flush=True)
            print("Ctrl-C (or SIGTERM, SIGHUP) stops everything", flush=True)
            while True:
                for line in site.stack.tell_ended(site.stack.supervise()):
                    print(line, flush=True)
                offset = check_refused(site, offset)
                time.sleep(DEFAULT_POLL_S)
    except Stopped:  # (the signal handler said it stops)
        return 0
    finally:
        site.stack.stop_all()


def credentials(folder: Path | None, name: str) -> tuple[auth.Credential, auth.Credential, Path | None]:
    """The site's credential, the worker credential and the CA: from the site's folder, else the environment."""
    if folder is None:
        seeds = {r: os.environ.get(f"CLEAVE_{r.upper()}_NATS_NKEY_SEED", "").strip() for r in (auth.SITE, "worker")}
        missing = [f"CLEAVE_{r.upper()}_NATS_NKEY_SEED" for r, v in seeds.items() if not v]
        if missing:
            raise ConfigError(f"site {name} has no credential: pass --auth with its folder (sites/{name}/ of the "
                              f"hub's `cleave auth init --sites {name}`), or set {' and '.join(missing)}")
        ca = os.environ.get("CLEAVE_SITE_NATS_TLS_CA")
        return (auth.credential_from_seed(f"{auth.SITE}-{name}", auth.SITE, seeds[auth.SITE]),
                auth.credential_from_seed("worker", "worker", seeds["worker"]), Path(ca) if ca else None)
    inner = site_folder(folder, name)
    if not (inner / auth_cmd.SITE_ENV).is_file():
        raise ConfigError(f"site {name} has no credential in {folder} ({auth_cmd.SITE_ENV} is missing): on the hub, "
                          f"`cleave auth init --sites {name}` writes sites/{name}/; copy that folder here")
    return (creds.credential(inner, "site", auth.SITE), creds.credential(inner, "worker", "worker"),
            creds.ca_file(inner))


def start_leaf(site: SiteRun, site_cred: auth.Credential, worker: auth.Credential) -> None:
    ca = site.ca
    monitor_port = free_port()
    opts = serverconf.LeafOptions(name=site.name, listen=f"{site.host}:{site.port}", http=f"127.0.0.1:{monitor_port}",
                                  hubs=site.hubs, ca_file=str(ca.resolve()) if ca else None)
    conf = site.stack.run_dir / "leaf.conf"
    write_atomic(conf, serverconf.leaf_config(site_cred, worker, opts), 0o600)  # it holds the seed
    proc = site.stack.spawn("nats-leaf", "nats", [nats_server_binary(), "-c", str(conf)], restart=True)
    site.stack.wait_ready(proc)
    site.stack.nats_url = site.url
    site.stack.nats_monitor = f"http://127.0.0.1:{monitor_port}"
    site.stack.leaf_url = ",".join(site.hubs)
    site.stack.write_stack_json()


def wait_linked(site: SiteRun, timeout_s: float) -> int:
    """Until the leaf node holds its link to the hub; ConfigError at once when the hub refuses it. Returns how
    far the leaf node's log is read: its lines from this run on (an earlier run's, in the same run dir, are that
    run's: they once ended a site linked well, or blamed a cause long gone)."""
    deadline, offset = time.monotonic() + timeout_s, site.stack.procs["nats-leaf"].log_offset
    while True:
        offset = check_refused(site, offset)
        try:
            if get_json(f"{site.stack.nats_monitor}/leafz").get("leafs"):
                return offset
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise ConfigError(f"site {site.name}: no link to the hub at {', '.join(site.hubs)} within {timeout_s:.0f}s: "
                              f"is it reachable from here (outbound TCP to its leaf-node port)? See {site.log}")
        time.sleep(DEFAULT_POLL_S)


def check_refused(site: SiteRun, offset: int) -> int:
    """Read the leaf node's new log lines from `offset`; ConfigError if the hub refused the site or its TLS failed.
    Returns the new offset. Only the link's own lines count: a client of the site that fails to log in, or a
    worker that publishes where it may not, is that client's error (they ended the site, blamed on the hub)."""
    try:
        with open(site.log, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except OSError:
        return offset
    end = chunk.rfind(b"\n") + 1  # whole lines only
    for raw in chunk[:end].decode(errors="replace").splitlines():
        low = raw.lower()
        if ("[err]" not in low and "error" not in low) or LINK not in low:
            continue
        if DUPLICATE in low:
            duplicate(site, raw)
            continue
        if WRONG_PORT in low:
            raise ConfigError(f"site {site.name}: {', '.join(site.hubs)} is a client port, not the hub's leaf-node "
                              "port: --hub takes the `sites dial tls://HOST:PORT` address `cleave up` prints (7422 "
                              "by default)")
        if any(k in low for k in REFUSED):
            raise ConfigError(f"the hub at {', '.join(site.hubs)} refused site {site.name}'s credential "
                              f"({raw.split(' - ')[-1].strip()}): give this site its own sites/{site.name}/ folder "
                              f"from the hub's `cleave auth init --sites {site.name}`")
        if any(k in low for k in UNVERIFIED):
            raise ConfigError(f"site {site.name} could not verify the hub's certificate ({raw.split(' - ')[-1].strip()}): "
                              f"the CA ({site.ca or 'the system trust store'}) must be the hub's, and the certificate "
                              f"must name the host "
                              f"in --hub")
    return offset + end


def duplicate(site: SiteRun, raw: str) -> None:
    """The hub holds another link with this site's credential (the site started again elsewhere, or two sites
    given one folder): the two links take turns, each dropped about once a second. The newcomer (told within
    DUPLICATE_GRACE_S of its first link, which it may get before the other takes it back) ends with that; a site
    linked for longer says so, once, and stays."""
    said = (f"site {site.name}: the hub at {', '.join(site.hubs)} already holds a link with this site's credential "
            f"(this site running on another machine, or another site given the folder sites/{site.name}/)")
    if site.linked_at is None or time.monotonic() - site.linked_at < DUPLICATE_GRACE_S:
        raise ConfigError(f"{said}: stop that one, or give each site its own folder (`cleave auth init --sites`)")
    if not site.told_duplicate:
        print(f"warning: {said}; the two links drop each other until one is stopped", file=sys.stderr, flush=True)
        site.told_duplicate = True
