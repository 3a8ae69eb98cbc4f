"""`cleave auth init`: write a nats-server config with per-role nkey users, their env files, and TLS files; and
reading them back: every command that takes `--auth DIR` finds its own credential here.

Layout of `--out DIR` (the server reads DIR as `--server-dir`, e.g. /etc/nats/auth under compose):
  nats.conf                 the server config: public keys and permissions only, no secrets
  <name>.env                one per credential (ps, scheduler, monitor, submitter, worker or worker-<id>), 0600
  admin.nk                  an unrestricted seed for operators' `nats --nkey admin.nk ...`, mode 0600
  tls/ca.pem                with --tls: the CA clients verify the server with (CLEAVE_*_NATS_TLS_CA)
  tls/server-cert.pem       with --tls: the server certificate (generated, or a copy of --tls-cert)
  tls/server-key.pem        with --tls: its key, mode 0600
  sites/<name>/             with --sites: what site <name> needs and nothing more (copy this folder there):
    site.env                  its leaf-node credential (CLEAVE_SITE_NATS_NKEY_SEED), mode 0600
    worker.env                its workers' own credential (a key of this site's alone, which its leaf node
                              accepts and the hub does not), mode 0600
    ca.pem                    the CA its leaf node verifies the hub with (with TLS)
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from pathlib import Path

from cleave import auth
from cleave.api.credentials import (  # reading the directory back: every --auth DIR
    CA_NAME,
    TLS_DIR,
)
from cleave.errors import ConfigError
from cleave.runtime.files import write_atomic
from cleave_cli import serverconf

CONFIG_NAME = "nats.conf"
CERT_NAME, KEY_NAME = "server-cert.pem", "server-key.pem"
ADMIN_NAME = "admin.nk"
SITES_DIR = "sites"
SITE_ENV = "site.env"
WORKER_ENV = "worker.env"  # a site's workers' credential, in its folder
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "nats")  # "nats" is the compose service name


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `cleave auth init` to the `cleave` parser."""
    p = subparsers.add_parser("auth", help="NATS credentials, permissions and TLS for a deployment")
    sub = p.add_subparsers(dest="auth_command", required=True)
    init = sub.add_parser("init", help="write a nats-server config and one credential per role")
    init.add_argument("--out", type=Path, required=True, help="directory to write (created if missing)")
    init.add_argument("--tls", action="store_true", help="serve TLS with a generated CA and certificate")
    init.add_argument("--host", action="append", dest="hosts",
                      help=f"a name or IP clients dial, for the generated certificate (repeatable; "
                           f"{', '.join(DEFAULT_HOSTS)} are always included)")
    init.add_argument("--tls-cert", type=Path, help="use this server certificate (PEM) instead of generating one")
    init.add_argument("--tls-key", type=Path, help="the key of --tls-cert (PEM)")
    init.add_argument("--tls-ca", type=Path,
                      help="the CA of --tls-cert, copied for clients (omit for a publicly trusted certificate)")
    init.add_argument("--worker-ids", default="",
                      help="comma-separated worker ids: one credential each, pinned to its own subjects, "
                           "instead of one shared worker credential")
    init.add_argument("--sites", default="", help="comma-separated site names: a leaf-node credential for each "
                      "(sites/<name>/), and the hub's leaf-node listener (--leaf-listen)")
    init.add_argument("--listen", default=serverconf.DEFAULT_LISTEN, help="client listener, host:port")
    init.add_argument("--leaf-listen", help=f"leaf-node listener for the sites, host:port (default with --sites: "
                                            f"{serverconf.DEFAULT_LEAF_LISTEN})")
    init.add_argument("--cluster", default="", help="comma-separated host[:port] of every node of a NATS cluster "
                      "(routes, TLS verified both ways; needs --tls or --tls-ca); each node is named with "
                      "nats-server --name")
    init.add_argument("--http", default=serverconf.DEFAULT_HTTP, help="monitoring listener (/healthz), host:port")
    init.add_argument("--store-dir", default="/data/jetstream", help="JetStream store, as the server sees it")
    init.add_argument("--server-dir", help="where the server sees --out (default: --out itself)")
    init.add_argument("--max-payload", type=int, default=serverconf.DEFAULT_MAX_PAYLOAD)
    init.add_argument("--force", action="store_true", help="overwrite existing credentials (re-issue all)")


def run(args: argparse.Namespace) -> int:
    """Run a parsed `cleave auth ...` command; returns the exit status."""
    if args.auth_command == "init":
        written = init(args)
        print(f"wrote {len(written)} files to {args.out}:")
        for path in written:
            print(f"  {path.relative_to(args.out)}")
        print("give each service its <role>.env (the worker's to every worker, the submitter's to whoever submits "
              "jobs); never the others;")
        if args.sites:
            print(f"copy {SITES_DIR}/<name>/ to site <name> (nothing else);")
        print(f"{ADMIN_NAME} is for operators' nats CLI only")
        return 0
    raise ConfigError(f"unknown auth command {args.auth_command!r}")


HOST_NAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*\.?$")


def check_host(host: str) -> str:
    """A name or IP address a certificate can name (what clients dial), or ConfigError."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not HOST_NAME.match(host):
        raise ConfigError(f"--host {host!r} is not a host name or IP address (e.g. hub.example.org or 203.0.113.7; "
                          "no scheme, no port)")
    return host


def init(args: argparse.Namespace) -> list[Path]:
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: the credentials are written into a folder")
    for host in args.hosts or ():
        if not args.tls:
            raise ConfigError(f"--host {host} names the generated certificate: it goes with --tls")
        check_host(host)
    if (out / CONFIG_NAME).exists() and not args.force:
        raise ConfigError(f"{out / CONFIG_NAME} exists: pass --force to re-issue every credential")
    uses_tls = args.tls or args.tls_cert is not None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if args.tls_ca and not args.tls_cert:
        raise ConfigError("--tls-ca is the CA of --tls-cert; without --tls-cert a CA is generated")
    worker_ids = tuple(w.strip() for w in args.worker_ids.split(",") if w.strip())
    creds = auth.credentials(worker_ids)  # validates ids and names before anything is written
    sites = [auth.site_credential(n) for n in _names(getattr(args, "sites", ""), "--sites")]
    if sites and worker_ids:  # a site's link carries every worker id's subjects (`*`): it would read theirs
        raise ConfigError("--sites and --worker-ids do not go together: a site's link may receive every worker "
                          "id's tiles, which undoes what --worker-ids pins; issue the sites' credentials "
                          "without --worker-ids")
    nodes = _names(getattr(args, "cluster", ""), "--cluster")
    if nodes and not (args.tls or args.tls_ca):
        raise ConfigError("--cluster: routes verify each other against a CA: pass --tls (or --tls-cert with --tls-ca)")
    admin = auth.admin_credential()
    out.mkdir(parents=True, exist_ok=True)
    server_dir = Path(args.server_dir) if args.server_dir else out.resolve()
    hosts = [h.rpartition(":")[0] if ":" in h else h for h in nodes]  # routes dial these names: certify them
    written = _write_tls(args, out, hosts) if uses_tls else []
    has_ca = (out / TLS_DIR / CA_NAME).exists() and uses_tls
    opts = serverconf.ServerOptions(
        listen=args.listen, http=args.http, store_dir=args.store_dir, max_payload=args.max_payload,
        tls_cert=(server_dir / TLS_DIR / CERT_NAME).as_posix() if uses_tls else None,
        tls_key=(server_dir / TLS_DIR / KEY_NAME).as_posix() if uses_tls else None,
        tls_ca=(server_dir / TLS_DIR / CA_NAME).as_posix() if has_ca else None,
        leaf_listen=getattr(args, "leaf_listen", None) or (serverconf.DEFAULT_LEAF_LISTEN if sites else None),
        routes=tuple(f"nats-route://{n if ':' in n else n + ':6222'}" for n in nodes),
    )
    config = serverconf.server_config([*creds, *sites, admin], opts)
    written.append(write_atomic(out / CONFIG_NAME, config.encode(), 0o644))
    for c in creds:
        written.append(write_atomic(out / f"{c.name}.env", auth.env_text(c).encode(), 0o600))
    written.append(write_atomic(out / ADMIN_NAME, (admin.seed + "\n").encode(), 0o600))
    for site in sites:
        folder = out / SITES_DIR / site.name.removeprefix(f"{auth.SITE}-")
        folder.mkdir(parents=True, exist_ok=True)
        written.append(write_atomic(folder / SITE_ENV, auth.env_text(site).encode(), 0o600))
        # its workers' own key, never the hub's: only its leaf node lists it (nats.conf does not), so the
        # folder gives no login on the hub, and deleting it cuts the site off entirely
        written.append(write_atomic(folder / WORKER_ENV, auth.env_text(auth.new_credential("worker")).encode(), 0o600))
        if has_ca:
            written.append(_copy(out / TLS_DIR / CA_NAME, folder / CA_NAME, 0o644))
    return written


def _names(listed: str, flag: str) -> list[str]:
    names = [n.strip() for n in (listed or "").split(",") if n.strip()]
    if len(set(names)) != len(names):
        raise ConfigError(f"{flag} lists a name twice")
    return names


def _write_tls(args: argparse.Namespace, out: Path, hosts: list[str] = ()) -> list[Path]:
    tls_dir = out / TLS_DIR
    tls_dir.mkdir(exist_ok=True)
    if args.tls_cert:
        for src in (args.tls_cert, args.tls_key, args.tls_ca):
            if src is not None and not src.is_file():
                raise ConfigError(f"{src}: no such file")
        written = [_copy(args.tls_cert, tls_dir / CERT_NAME, 0o644), _copy(args.tls_key, tls_dir / KEY_NAME, 0o600)]
        if args.tls_ca:
            written.append(_copy(args.tls_ca, tls_dir / CA_NAME, 0o644))
        return written
    material = serverconf.generate_tls(list(dict.fromkeys([*DEFAULT_HOSTS, *(args.hosts or ()), *hosts])))
    return [write_atomic(tls_dir / CA_NAME, material.ca_pem, 0o644),
            write_atomic(tls_dir / CERT_NAME, material.cert_pem, 0o644),
            write_atomic(tls_dir / KEY_NAME, material.key_pem, 0o600)]


def _copy(src: Path, dst: Path, mode: int) -> Path:
    return write_atomic(dst, src.read_bytes(), mode)
