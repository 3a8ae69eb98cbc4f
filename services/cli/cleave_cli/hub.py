"""The hub of a deployment (`cleave up --listen HOST --auth DIR`): where its nats-server listens, with which
users and TLS, and the credential each of its services logs in with.

- NATS: clients on HOST:4222 and the sites' leaf nodes on HOST:7422, both with TLS when DIR holds a certificate
  (`cleave auth init --tls --host HOST`). Its users are DIR's credentials (every role, each site, the admin),
  derived again from their seeds each time, so the server always matches DIR. Monitoring stays on 127.0.0.1.
- Services log in with their role's seed and DIR's CA (the PS job runner as the PS).
- Without DIR nothing listens beyond this machine: `--listen` off the loopback needs `--auth`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path

from cleave import auth
from cleave.api import contact, credentials
from cleave.api.natsconf import free_port
from cleave.bus.limits import SERVER_LIMITS
from cleave.errors import ConfigError
from cleave.runtime.files import write_atomic
from cleave_cli import auth_cmd, serverconf

DEFAULT_CLIENT_PORT = 4222
DEFAULT_LEAF_PORT = 7422
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::", "")
DEFAULT_LOGIN_TIMEOUT_S = 10.0
SITE_WORKERS = f"{auth_cmd.SITES_DIR}/*/{auth_cmd.WORKER_ENV}"  # each site's workers' key, in its folder
SHARED_KEY_GIVEN = ".shared-worker-key-given.json"  # sites seen holding the shared worker key: name -> its public
LOGIN_ROLES = {"runner": "ps"}  # a process role -> the credential it logs in with, where they differ
PLAIN_CONFIG = """\
listen: "{listen}"
http: 127.0.0.1:{monitor_port}
max_payload: {max_payload}
{limits}
jetstream {{
  store_dir: "{store}"
}}
leafnodes {{
  listen: "{leaf}"
}}
"""


def split_listen(listen: str, default_port: int, flag: str = "--listen") -> tuple[str, int]:
    """HOST or HOST:PORT ([v6]:PORT) -> (host, port); port 0 picks a free one. `flag` names it in the error."""
    host, sep, port = listen.rpartition(":") if listen.count(":") == 1 or listen.startswith("[") else ("", "", "")
    if not sep:
        host, port = listen, str(default_port)
    host = host.strip("[]")
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{flag} {listen!r}: expected HOST or HOST:PORT (a port up to 65535)")
    return host, int(port) or free_port()


@dataclass
class HubConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_CLIENT_PORT
    leaf_port: int = DEFAULT_LEAF_PORT
    auth_dir: Path | None = None
    creds: list[auth.Credential] = field(default_factory=list)  # every user of the server (from auth_dir)

    @classmethod
    def of(cls, listen: str | None, auth_dir: Path | None, leaf_port: int = DEFAULT_LEAF_PORT) -> HubConfig:
        host, port = split_listen(listen or "127.0.0.1:0", DEFAULT_CLIENT_PORT)  # no --listen: free ports
        if auth_dir is None and host not in LOOPBACK:
            raise ConfigError(f"--listen {host} opens NATS beyond this machine: it needs credentials (--auth DIR, "
                              "written by `cleave auth init --tls --host NAME`)")
        hub = cls(host, port, (leaf_port if listen else 0) or free_port(), auth_dir)
        if auth_dir is not None:
            hub.creds = users(auth_dir)
            tls = auth_dir / auth_cmd.TLS_DIR
            if host not in LOOPBACK and not hub.tls:  # (credentials and their signatures in plain text)
                raise ConfigError(f"--listen {host} opens NATS beyond this machine, which takes TLS, but {auth_dir} has "
                                  f"no {auth_cmd.TLS_DIR}/{auth_cmd.CERT_NAME}: write it with `cleave auth init --tls "
                                  "--host NAME` (NAME: how sites and submitters reach this machine)")
            if hub.tls and not (tls / auth_cmd.KEY_NAME).is_file():
                raise ConfigError(f"{tls / auth_cmd.CERT_NAME} has no key beside it ({auth_cmd.KEY_NAME}): copy the "
                                  "whole auth folder, or write it again with `cleave auth init --tls`")
        return hub

    @property
    def tls(self) -> bool:
        return self.auth_dir is not None and (self.auth_dir / auth_cmd.TLS_DIR / auth_cmd.CERT_NAME).is_file()

    @property
    def url(self) -> str:
        """Where the hub's own services dial (the loopback for a wildcard address)."""
        host = "127.0.0.1" if self.host in WILDCARD else self.host
        return f"{'tls' if self.tls else 'nats'}://{_bracket(host)}:{self.port}"

    @property
    def leaf_url(self) -> str:
        """What `cleave site --hub` takes (for a wildcard address, with this machine's name in it)."""
        import socket

        host = socket.gethostname() if self.host in WILDCARD else self.host
        return f"{'tls' if self.tls else 'nats-leaf'}://{_bracket(host)}:{self.leaf_port}"

    def leaf_unnamed(self) -> str | None:
        """When the certificate does not name the host in `leaf_url` (this machine's name, for a wildcard address),
        sites that dial it fail TLS: what to tell the operator; None when it does, or there is no TLS."""
        if not self.tls:
            return None
        from urllib.parse import urlparse

        from cryptography import x509

        cert = x509.load_pem_x509_certificate((self.auth_dir / auth_cmd.TLS_DIR / auth_cmd.CERT_NAME).read_bytes())
        names = [str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value]
        host = urlparse(self.leaf_url).hostname or ""
        if any(fnmatch.fnmatch(host.lower(), name.lower()) for name in names):
            return None
        return (f"the hub's certificate names {', '.join(names)}, not {host}: sites dial one of its names "
                f"(cleave site --hub tls://NAME:{self.leaf_port}), or issue one that names this machine "
                f"(cleave auth init --tls --host {host})")

    def sites_with_hub_keys(self) -> str | None:
        """Sites given one of this hub's worker keys (an older `cleave auth init` copied the shared worker.env
        into their folders): the client port takes it, so deleting such a folder does not cut its site off. Those
        seen are recorded (sites/SHARED_KEY_GIVEN) and told of until the key changes, their folders gone or not.
        What to tell the operator; None when no site was."""
        if self.auth_dir is None:
            return None
        shared = next((c.public for c in self.creds if c.name == "worker"), None)
        own = {c.seed for c in self.creds if c.role == "worker"}
        names = {path.parent.name for path in self.auth_dir.glob(SITE_WORKERS) if _seed(path) in own}
        given = self.auth_dir / auth_cmd.SITES_DIR / SHARED_KEY_GIVEN
        with contextlib.suppress(OSError, ValueError, AttributeError):  # (unreadable or unwritable: folders tell)
            held = json.loads(given.read_text()) if given.is_file() else {}
            names |= {name for name, public in held.items() if public == shared}
            if names:
                write_atomic(given, json.dumps({name: shared for name in sorted(names)}, indent=1))
        if not names:
            return None
        return (f"site{'s' if len(names) > 1 else ''} {', '.join(sorted(names))} {'were' if len(names) > 1 else 'was'} "
                f"given this hub's shared worker key ({self.auth_dir}/{auth_cmd.SITES_DIR}/<name>/{auth_cmd.WORKER_ENV}"
                " of an older `cleave auth init`): with it a site logs in here as any worker, and deleting its folder "
                f"does not revoke it. Re-issue every credential: `cleave auth init --force --out {self.auth_dir}` "
                "(your other options as before), then give each site its folder again and the hub's workers the new "
                "worker.env")

    def server_config(self, store: str, monitor_port: int, max_payload: int) -> str:
        listen, leaf = f"{_bracket(self.host)}:{self.port}", f"{_bracket(self.host)}:{self.leaf_port}"
        if self.auth_dir is None:
            return PLAIN_CONFIG.format(listen=listen, monitor_port=monitor_port, max_payload=max_payload,
                                       limits=SERVER_LIMITS, store=store, leaf=leaf)
        tls = self.auth_dir.resolve() / auth_cmd.TLS_DIR
        opts = serverconf.ServerOptions(
            listen=listen, http=f"127.0.0.1:{monitor_port}", store_dir=store, max_payload=max_payload,
            tls_cert=str(tls / auth_cmd.CERT_NAME) if self.tls else None,
            tls_key=str(tls / auth_cmd.KEY_NAME) if self.tls else None, leaf_listen=leaf)
        return serverconf.server_config(self.creds, opts)

    def env(self, role: str) -> dict[str, str]:
        """The CLEAVE_<ROLE>_* variables a process of `role` logs in with (none without credentials)."""
        if self.auth_dir is None:
            return {}
        return credentials.role_env(self.auth_dir, LOGIN_ROLES.get(role, role))

    def check_login(self) -> None:
        """Log in once as the PS: a certificate that does not name the address, or a credential the server does
        not know, is said now rather than by every service retrying forever."""
        if self.auth_dir is None:
            return
        options = credentials.client_options(self.auth_dir, "ps")
        said = asyncio.run(contact.first_try(self.url, options, self.auth_dir, "ps", DEFAULT_LOGIN_TIMEOUT_S))
        if said is not None:
            raise ConfigError(f"the hub's own services cannot log in at {self.url}: {said.reason}")


def users(folder: Path) -> list[auth.Credential]:
    """Every credential `cleave auth init` wrote into `folder` (roles, workers, sites, the admin's key)."""
    creds = []
    for path in sorted(folder.glob("*.env")):
        name = path.stem
        role = "worker" if name.startswith("worker") else name
        if role not in auth.ROLES:
            continue
        creds.append(credentials.credential(folder, name, role))
    for path in sorted((folder / auth_cmd.SITES_DIR).glob(f"*/{auth_cmd.SITE_ENV}")):  # (not a site's workers':
        # sites/<name>/worker.env is its leaf node's user, never the hub's)
        creds.append(_site(path))
    admin = folder / auth_cmd.ADMIN_NAME
    if admin.is_file():
        creds.append(auth.admin_credential(admin.read_text().strip()))
    if not any(c.role == "ps" for c in creds):
        raise ConfigError(f"{folder} holds no credentials of `cleave auth init` (ps.env is missing)")
    return creds


def _seed(path: Path) -> str:
    return next((v.strip() for k, v in credentials.read_env(path).items() if k.endswith("_NATS_NKEY_SEED")), "")


def _site(path: Path) -> auth.Credential:
    cred = credentials.credential(path.parent, path.stem, auth.SITE)
    return auth.Credential(f"{auth.SITE}-{path.parent.name}", auth.SITE, cred.seed, cred.public, cred.permissions)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
