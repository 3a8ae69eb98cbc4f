"""nats-server configs with credentials, as the `cleave` command writes them, and the TLS material they use.

- `server_config`: the hub's server (`cleave auth init`'s nats.conf, `cleave up --listen --auth`): listeners,
  JetStream, TLS, one nkey user per credential with its permissions (`cleave.auth`), a leaf-node listener for
  the sites (each site logs in with its own credential, which makes leaf links only) and a cluster's routes
  (TLS verified at both ends against the CA).
- `leaf_config`: a site's leaf node (`cleave site`): its workers log in with the site's own worker credential
  (its folder's worker.env, which no hub config lists); it dials the hub with the site's credential over TLS,
  verifying the hub against the CA.
- `generate_tls`: a throwaway CA and a server certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
from dataclasses import dataclass

from cleave.auth import ADMIN, SITE, Credential
from cleave.bus.limits import SERVER_LIMITS
from cleave.errors import ConfigError

DEFAULT_LISTEN = "0.0.0.0:4222"
DEFAULT_HTTP = "127.0.0.1:8222"  # monitoring (/healthz); never publish it: /connz lists every client
DEFAULT_LEAF_LISTEN = "0.0.0.0:7422"  # sites' leaf nodes dial the hub here
DEFAULT_CLUSTER_LISTEN = "0.0.0.0:6222"
CLUSTER_NAME = "cleave"
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024  # the codec chunks anything larger
DEFAULT_TLS_TIMEOUT_S = 5
DEFAULT_CERT_DAYS = 825  # the longest validity some TLS clients accept


@dataclass(frozen=True)
class ServerOptions:
    listen: str = DEFAULT_LISTEN
    http: str = DEFAULT_HTTP
    store_dir: str = "/data/jetstream"
    max_payload: int = DEFAULT_MAX_PAYLOAD
    tls_cert: str | None = None  # paths as nats-server sees them
    tls_key: str | None = None
    tls_ca: str | None = None  # with routes: the CA both ends of a route verify each other with
    leaf_listen: str | None = None  # sites' leaf nodes dial here (their credentials, TLS as the clients')
    routes: tuple[str, ...] = ()  # a cluster: nats-route://host:port of every node (TLS verified both ways)
    cluster_listen: str = DEFAULT_CLUSTER_LISTEN


def _q(s: str) -> str:
    return json.dumps(s)  # a quoted string: `$` inside quotes is not a variable for nats-server


def _subjects(subjects: tuple[str, ...]) -> str:
    return "[\n" + "".join(f"          {_q(s)},\n" for s in subjects) + "        ]"


def _user_block(c: Credential) -> str:
    p = c.permissions
    if c.role == ADMIN:  # every subject, but client connections only: not a leaf link with all rights
        return (f"    # {c.name}: unrestricted subjects, for operators\n"
                f"    {{ nkey: {_q(c.public)}, allowed_connection_types: [\"STANDARD\"] }}")
    resp = "\n        allow_responses: true" if p.allow_responses else ""
    deny = f", deny: {_subjects(p.subscribe_deny)}" if p.subscribe_deny else ""  # (`*`: one token, never `>`)
    kind = "LEAFNODE" if c.role == SITE else "STANDARD"  # a site's key makes leaf links only; no other key does
    return (f"    # {c.name}\n    {{\n      nkey: {_q(c.public)}\n      allowed_connection_types: [{_q(kind)}]\n"
            f"      permissions: {{\n"
            f"        publish: {{ allow: {_subjects(p.publish)} }}\n"
            f"        subscribe: {{ allow: {_subjects(p.subscribe)}{deny} }}{resp}\n      }}\n    }}")


def server_config(creds: list[Credential], opts: ServerOptions) -> str:
    """A complete nats-server config: listeners, JetStream, optional TLS, and one user per credential."""
    if (opts.tls_cert is None) != (opts.tls_key is None):
        raise ConfigError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
    tls = _tls_block(opts, "") if opts.tls_cert else ""
    if opts.routes and not (opts.tls_cert and opts.tls_ca):
        raise ConfigError("a cluster's routes verify each other with TLS: it needs a certificate and its CA "
                          "(--tls, or --tls-cert with --tls-ca)")
    users = ",\n".join(_user_block(c) for cred in creds for c in (cred, *cred.companions))
    return (
        "# nats-server config written by `cleave auth init`: per-role nkey users and subject permissions\n"
        "# derived from cleave.schemas. It holds public keys only; the seeds are in the <role>.env files.\n"
        f"listen: {_q(opts.listen)}\nhttp: {_q(opts.http)}\nmax_payload: {opts.max_payload}\n"
        "# slow consumers: the PS keeps less than this in flight to any worker (docs/operations.md)\n"
        f"{SERVER_LIMITS}\n"
        f"jetstream {{\n  store_dir: {_q(opts.store_dir)}\n"
        "  # fsync before acknowledging: without it an acknowledged write can be lost on an OS crash\n"
        "  # (measured: 64 KiB sync publishes 4.4k/s -> 1.5k/s; Cleave's JetStream traffic is far below)\n"
        "  sync_interval: always\n}\n"
        f"{tls}{_leaf_block(opts)}{_cluster_block(opts)}authorization {{\n  users: [\n{users}\n  ]\n}}\n"
    )


def _tls_block(opts: ServerOptions, indent: str, verify: bool = False) -> str:
    lines = [f"cert_file: {_q(opts.tls_cert)}", f"key_file: {_q(opts.tls_key)}", f"timeout: {DEFAULT_TLS_TIMEOUT_S}"]
    if verify:
        lines += [f"ca_file: {_q(opts.tls_ca)}", "verify: true"]
    return f"{indent}tls {{\n" + "".join(f"{indent}  {x}\n" for x in lines) + f"{indent}}}\n"


def _leaf_block(opts: ServerOptions) -> str:
    """Sites' leaf nodes log in with their site credential (the users below, LEAFNODE only), over TLS."""
    if not opts.leaf_listen:
        return ""
    tls = _tls_block(opts, "  ") if opts.tls_cert else ""
    return f"leafnodes {{\n  listen: {_q(opts.leaf_listen)}\n{tls}}}\n"


def _cluster_block(opts: ServerOptions) -> str:
    """Routes between the hub's nodes: TLS both ways, each end's certificate verified against the CA (name each
    node with `nats-server --name`)."""
    if not opts.routes:
        return ""
    routes = ", ".join(_q(r) for r in opts.routes)
    return (f"cluster {{\n  name: {CLUSTER_NAME}\n  listen: {_q(opts.cluster_listen)}\n  routes: [{routes}]\n"
            f"{_tls_block(opts, '  ', verify=True)}}}\n")


# ---- TLS ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TlsMaterial:
    ca_pem: bytes  # give to every client (CLEAVE_*_NATS_TLS_CA)
    cert_pem: bytes  # the server's certificate, signed by the CA
    key_pem: bytes  # the server's private key; the CA's key is discarded after signing


def generate_tls(hosts: list[str], days: int = DEFAULT_CERT_DAYS) -> TlsMaterial:
    """A throwaway CA and a server certificate for `hosts` (DNS names or IP addresses)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if not hosts:
        raise ConfigError("TLS needs at least one host name for the certificate (--host)")
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cleave nats CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)  # client too: cluster routes dial each other
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return TlsMaterial(ca.public_bytes(pem), cert.public_bytes(pem), key_pem)



# ---- a site's leaf node ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeafOptions:
    name: str  # the site's name: the server's name is leaf-<name>
    listen: str  # where the site's workers connect
    http: str  # monitoring (/leafz tells whether the link to the hub is up)
    hubs: tuple[str, ...]  # the hub's leaf-node URLs (tls://host:7422); it fails over between them
    ca_file: str | None = None  # the CA the hub's certificate is verified with; None: the system's
    max_payload: int = DEFAULT_MAX_PAYLOAD


def leaf_config(site: Credential, worker: Credential, opts: LeafOptions) -> str:
    """A site's leaf nats-server: its one local user is `worker`, the site's own worker credential (the hub
    never lists it). It holds the site's seed (the leaf link logs in with it): write it 0600."""
    if site.role != SITE or worker.role != "worker":
        raise ConfigError(f"a site's leaf node needs a site and a worker credential, got {site.name}, {worker.name}")
    tls = ""
    if opts.ca_file or any(h.startswith("tls://") for h in opts.hubs):
        tls = f"    tls {{ ca_file: {_q(opts.ca_file)} }}\n" if opts.ca_file else "    tls {}\n"
    hubs = ", ".join(_q(h) for h in opts.hubs)
    return (
        f"# the leaf node of site {opts.name}, written by `cleave site`: it holds the site's seed, keep it private\n"
        f"server_name: {_q('leaf-' + opts.name)}\nlisten: {_q(opts.listen)}\nhttp: {_q(opts.http)}\n"
        f"max_payload: {opts.max_payload}\n{SERVER_LIMITS}\n"
        f"authorization {{\n  users: [\n{_user_block(worker)}\n  ]\n}}\n"
        f"leafnodes {{\n  remotes: [\n  {{\n    urls: [{hubs}]\n    nkey: {_q(site.seed)}\n{tls}  }}\n  ]\n}}\n"
    )
