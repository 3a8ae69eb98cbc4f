"""Per-role NATS credentials, the subject permissions each role gets, the server config, and TLS material.

Pure: everything here builds text, keys and option dicts; `cleave auth init` writes them to disk. Every
subject comes from `cleave.schemas`, so a renamed subject or bucket changes the permissions with it.

Roles and what they may do (anything not listed is refused by nats-server):
- ps: publish tiles, fan-out blocks, joins and link checks, events and its own state (KV + Object Store), its job's
  GEMM shapes (the plans bucket's `shapes` key only) and what it observed of the workers; subscribe to results.
- scheduler: publish the registry and the plan (KV) and events; subscribe to heartbeats and to what the PS
  observed of the workers. Probes are answered by a credential of its own (`scheduler-probe`, its seed in
  scheduler.env beside the scheduler's), which may subscribe to probe requests and publish to the workers'
  inboxes (`_INBOX.worker.>`) and nowhere else: an answer aimed at a bucket or the JetStream API is refused
  by the server whatever a request names as its reply.
- monitor: reads the events stream, the registry and plan buckets, live heartbeats and events; writes
  nothing (it may create the streams and buckets, as every service runs `Bus.setup()`).
- worker: subscribe to its tiles, its control subject and the fan-out subjects (shared input blocks, which
  carry no secret of other workers: every worker may be sent any block), publish results, heartbeats and
  probe requests, answer the PS's fan-out joins and link checks (`allow_responses`), read the replies to its probes; no
  JetStream. With `worker_id`, tiles, results, round updates, heartbeats, probes and probe replies are pinned
  to that id (each on a per-worker subject); the shared worker credential gets a `*` (or `>`) in place of the id.
Each role gets a private reply prefix `_INBOX.<role>` (`_INBOX.worker.<id>` for a worker), passed by
`connect_options`, so no role can read another's replies (JetStream API answers included).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import ssl
from dataclasses import dataclass
from typing import Any

import nkeys

from cleave.bus import SERVER_LIMITS
from cleave.errors import ConfigError
from cleave.schemas import (
    EVENTS_STREAM,
    PLAN_BUCKET,
    REGISTRY_BUCKET,
    SHAPES_KEY,
    STATE_BUCKET,
    STATE_OBJECTS,
    SUBJECT_CONTROL,
    SUBJECT_EVENTS_ALL,
    SUBJECT_FANOUT,
    SUBJECT_HEARTBEAT,
    SUBJECT_LINKCHECK,
    SUBJECT_OBSERVED,
    SUBJECT_OBSERVED_ALL,
    SUBJECT_PROBE_ALL,
    SUBJECT_PROBE_FROM,
    SUBJECT_RESULTS,
    SUBJECT_ROUNDCAST_ALL,
    SUBJECT_ROUNDS,
    SUBJECT_SPLIT,
    SUBJECT_TILES,
    SUBJECT_UPDATES,
)

ROLES = ("ps", "scheduler", "monitor", "worker")
PROBE_ECHO = "scheduler-probe"  # the scheduler's second credential: it answers probes and may do nothing else
ADMIN = "admin"  # operators' credential for the `nats` CLI: unrestricted, never given to a service
SERVICE_ROLES = ("ps", "scheduler", "monitor")  # the trusted side; workers may be strangers' machines
INBOX_ROOT = "_INBOX"
DEFAULT_LISTEN = "0.0.0.0:4222"
DEFAULT_HTTP = "127.0.0.1:8222"  # monitoring (/healthz); never publish it: /connz lists every client
DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024  # the codec chunks anything larger
DEFAULT_TLS_TIMEOUT_S = 5
DEFAULT_CERT_DAYS = 825  # the longest validity some TLS clients accept
WORKER_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _kv(bucket: str) -> str:
    return f"KV_{bucket}"


def _obj(bucket: str) -> str:
    return f"OBJ_{bucket}"


def _wild(pattern: str) -> str:
    """A subject pattern with every `{field}` replaced by `*`, e.g. cleave.result.*.*"""
    parts = [("*" if p.startswith("{") and p.endswith("}") else p) for p in pattern.split(".")]
    return ".".join(parts)


# Streams every service's `Bus.setup()` creates when missing (the PS also creates its Object Store).
SETUP_STREAMS = (EVENTS_STREAM, _kv(REGISTRY_BUCKET), _kv(PLAN_BUCKET), _kv(STATE_BUCKET))


# ---- permissions -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False  # may answer a request it received, once (probes)


def inbox_prefix(role: str, worker_id: str | None = None) -> str:
    """The reply-subject prefix a role uses; its request replies (JetStream API answers) arrive below it."""
    return f"{INBOX_ROOT}.{role}" if worker_id is None else f"{INBOX_ROOT}.{role}.{worker_id}"


def _js_create(stream: str) -> list[str]:
    return [f"$JS.API.STREAM.CREATE.{stream}", f"$JS.API.STREAM.INFO.{stream}"]


def _js_read(stream: str) -> list[str]:
    """Read a stream: message get (direct or not), ephemeral and durable consumers, flow control and acks."""
    api = "$JS.API"
    return [
        f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}", f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.CONSUMER.CREATE.{stream}", f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.DURABLE.CREATE.{stream}.>", f"{api}.CONSUMER.INFO.{stream}.>",
        f"{api}.CONSUMER.DELETE.{stream}.>", f"{api}.CONSUMER.MSG.NEXT.{stream}.>",
        f"$JS.FC.{stream}.>", f"$JS.ACK.{stream}.>",
    ]


def _kv_write(bucket: str) -> list[str]:
    return [f"$KV.{bucket}.>", f"$JS.API.STREAM.PURGE.{_kv(bucket)}"]


def _obj_write(bucket: str) -> list[str]:
    return [f"$O.{bucket}.>", f"$JS.API.STREAM.PURGE.{_obj(bucket)}"]


def _service(role: str, publish: list[str], subscribe: list[str], allow_responses: bool = False) -> Permissions:
    common = ["$JS.API.INFO", "$JS.API.STREAM.NAMES"]
    return Permissions(tuple(dict.fromkeys(common + publish)),
                       tuple(dict.fromkeys([f"{inbox_prefix(role)}.>", *subscribe])), allow_responses)


def permissions(role: str, worker_id: str | None = None) -> Permissions:
    """The subjects one role may publish and subscribe to (see the module docstring)."""
    if role == "ps":
        pub = [_wild(SUBJECT_TILES), _wild(SUBJECT_FANOUT), _wild(SUBJECT_CONTROL), _wild(SUBJECT_LINKCHECK),
               _wild(SUBJECT_ROUNDS), _wild(SUBJECT_OBSERVED),
               SUBJECT_ROUNDCAST_ALL, _wild(SUBJECT_SPLIT), SUBJECT_EVENTS_ALL,
               *_kv_write(STATE_BUCKET), *_obj_write(STATE_OBJECTS),
               f"$KV.{PLAN_BUCKET}.{SHAPES_KEY}"]  # its job's GEMMs, for the scheduler (the key, not the plans)
        for s in (*SETUP_STREAMS, _obj(STATE_OBJECTS)):
            pub += _js_create(s)
        for s in (_kv(PLAN_BUCKET), _kv(REGISTRY_BUCKET), _kv(STATE_BUCKET), _obj(STATE_OBJECTS)):
            pub += _js_read(s)
        return _service(role, pub, [_wild(SUBJECT_RESULTS), _wild(SUBJECT_UPDATES)])
    if role == "scheduler":
        pub = [SUBJECT_EVENTS_ALL, *_kv_write(REGISTRY_BUCKET), *_kv_write(PLAN_BUCKET)]
        for s in SETUP_STREAMS:
            pub += _js_create(s)
        for s in (_kv(PLAN_BUCKET), _kv(REGISTRY_BUCKET)):
            pub += _js_read(s)
        return _service(role, pub, [_wild(SUBJECT_HEARTBEAT), SUBJECT_OBSERVED_ALL])
    if role == "monitor":  # writes nothing; may create the streams because it runs Bus.setup() too
        pub = []
        for s in SETUP_STREAMS:
            pub += _js_create(s)
        for s in (EVENTS_STREAM, _kv(PLAN_BUCKET), _kv(REGISTRY_BUCKET)):
            pub += _js_read(s)
        return _service(role, pub, [SUBJECT_EVENTS_ALL, _wild(SUBJECT_HEARTBEAT)])
    if role == "worker":
        wid = "*" if worker_id is None else check_worker_id(worker_id)
        inbox = f"{inbox_prefix(role)}.>" if worker_id is None else f"{inbox_prefix(role, worker_id)}.>"
        return Permissions(
            publish=(SUBJECT_RESULTS.format(job="*", epoch="*", worker_id=wid),
                     SUBJECT_UPDATES.format(job="*", epoch="*", worker_id=wid), SUBJECT_HEARTBEAT.format(worker_id=wid),
                     SUBJECT_PROBE_FROM.format(worker_id=wid)),
            subscribe=(SUBJECT_TILES.format(worker_id=wid), _wild(SUBJECT_FANOUT), SUBJECT_CONTROL.format(worker_id=wid),
                       SUBJECT_LINKCHECK.format(worker_id=wid),
                       SUBJECT_ROUNDS.format(worker_id=wid), SUBJECT_ROUNDCAST_ALL, SUBJECT_SPLIT.format(worker_id=wid),
                       inbox),
            allow_responses=True,  # its answers to the PS's fan-out joins and link checks
        )
    raise ConfigError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")


def probe_permissions() -> Permissions:
    """The probe echo's credential (`PROBE_ECHO`): probe requests in, answers to the workers' inboxes only."""
    return Permissions(publish=(f"{inbox_prefix('worker')}.>",), subscribe=(SUBJECT_PROBE_ALL,))


def check_worker_id(worker_id: str) -> str:
    if not 0 < len(worker_id) <= 128 or not set(worker_id) <= WORKER_ID_CHARS:
        raise ConfigError(f"worker id {worker_id!r}: use 1-128 of A-Z a-z 0-9 _ - (--worker-ids)")
    return worker_id


# ---- credentials -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Credential:
    """One NATS user: an nkey (the seed is the secret; the server holds only the public key)."""

    name: str  # "ps", "worker", "worker-<id>": names its files
    role: str
    seed: str
    public: str
    permissions: Permissions
    companions: tuple[Credential, ...] = ()  # more users the same service holds (the scheduler's probe echo)

    @property
    def env_var(self) -> str:
        if self.name == PROBE_ECHO:
            return "CLEAVE_SCHEDULER_PROBE_NKEY_SEED"
        return f"CLEAVE_{self.role.upper()}_NATS_NKEY_SEED"


def new_credential(role: str, worker_id: str | None = None) -> Credential:
    seed, public = _nkey()
    name = role if worker_id is None else f"{role}-{worker_id}"
    companions = ()
    if role == "scheduler":
        echo_seed, echo_public = _nkey()
        companions = (Credential(PROBE_ECHO, role, echo_seed, echo_public, probe_permissions()),)
    return Credential(name, role, seed, public, permissions(role, worker_id), companions)


def _nkey() -> tuple[str, str]:
    """A new user nkey: (seed, public key)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode(), nkeys.from_seed(bytearray(seed)).public_key.decode()


def admin_credential() -> Credential:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    return Credential(ADMIN, ADMIN, seed.decode(), public, Permissions(publish=(">",), subscribe=(">",)))


def credentials(worker_ids: tuple[str, ...] = ()) -> list[Credential]:
    """One credential per service role, and either one shared worker credential or one per worker id."""
    creds = [new_credential(r) for r in SERVICE_ROLES]
    if worker_ids:
        if len(set(worker_ids)) != len(worker_ids):
            raise ConfigError("--worker-ids lists an id twice")
        creds += [new_credential("worker", check_worker_id(w)) for w in worker_ids]
    else:
        creds.append(new_credential("worker"))
    return creds


def env_text(cred: Credential, tls_ca: str | None = None, nats_url: str | None = None) -> str:
    """The role's settings as an env file (compose `env_file`, or `set -a; . worker.env`)."""
    prefix = f"CLEAVE_{cred.role.upper()}_"
    lines = [f"# {cred.name}: NATS credential written by `cleave auth init`; keep it secret", f"{cred.env_var}={cred.seed}"]
    lines += [f"{c.env_var}={c.seed}" for c in cred.companions]
    if tls_ca:
        lines.append(f"{prefix}NATS_TLS_CA={tls_ca}")
    if nats_url:
        lines.append(f"{prefix}NATS_URL={nats_url}")
    return "\n".join(lines) + "\n"


# ---- server config -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerOptions:
    listen: str = DEFAULT_LISTEN
    http: str = DEFAULT_HTTP
    store_dir: str = "/data/jetstream"
    max_payload: int = DEFAULT_MAX_PAYLOAD
    tls_cert: str | None = None  # paths as nats-server sees them
    tls_key: str | None = None


def _q(s: str) -> str:
    return json.dumps(s)  # a quoted string: `$` inside quotes is not a variable for nats-server


def _subjects(subjects: tuple[str, ...]) -> str:
    return "[\n" + "".join(f"          {_q(s)},\n" for s in subjects) + "        ]"


def _user_block(c: Credential) -> str:
    p = c.permissions
    if c.role == ADMIN:
        return f"    # {c.name}: unrestricted, for operators\n    {{ nkey: {_q(c.public)} }}"
    resp = "\n        allow_responses: true" if p.allow_responses else ""
    return (f"    # {c.name}\n    {{\n      nkey: {_q(c.public)}\n      permissions: {{\n"
            f"        publish: {{ allow: {_subjects(p.publish)} }}\n"
            f"        subscribe: {{ allow: {_subjects(p.subscribe)} }}{resp}\n      }}\n    }}")


def server_config(creds: list[Credential], opts: ServerOptions) -> str:
    """A complete nats-server config: listeners, JetStream, optional TLS, and one user per credential."""
    if (opts.tls_cert is None) != (opts.tls_key is None):
        raise ConfigError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
    tls = ""
    if opts.tls_cert:
        tls = (f"tls {{\n  cert_file: {_q(opts.tls_cert)}\n  key_file: {_q(opts.tls_key)}\n"
               f"  timeout: {DEFAULT_TLS_TIMEOUT_S}\n}}\n")
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
        f"{tls}authorization {{\n  users: [\n{users}\n  ]\n}}\n"
    )


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


# ---- the client side ---------------------------------------------------------------------------------
def connect_options(settings: Any, role: str) -> dict[str, Any]:
    """`nats.connect` keyword options from a service's settings: credentials, TLS, the role's reply prefix.

    A worker's reply prefix carries its id, which a per-worker credential requires (`--worker-ids`).

    Reads `nats_nkey_seed` (preferred) or `nats_user`/`nats_password`, and `nats_tls_ca`; any may be absent.
    """
    if role not in ROLES:
        raise ConfigError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    worker_id = getattr(settings, "worker_id", None) if role == "worker" else None
    opts: dict[str, Any] = {"inbox_prefix": inbox_prefix(role, worker_id)}
    seed = _secret(getattr(settings, "nats_nkey_seed", None))
    user = getattr(settings, "nats_user", "") or ""
    if seed and user:
        raise ConfigError(f"set either the nkey seed or nats_user/nats_password for {role}, not both")
    if seed:
        if not seed.startswith("SU"):
            raise ConfigError(f"CLEAVE_{role.upper()}_NATS_NKEY_SEED is not a NATS user seed (it starts with SU)")
        opts["nkeys_seed_str"] = seed
    elif user:
        opts["user"], opts["password"] = user, _secret(getattr(settings, "nats_password", None))
    ca = getattr(settings, "nats_tls_ca", None)
    if ca:
        try:
            opts["tls"] = ssl.create_default_context(cafile=str(ca))
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"CLEAVE_{role.upper()}_NATS_TLS_CA={ca}: {e}") from None
    return opts


def _secret(value: Any) -> str:
    if value is None:
        return ""
    return value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
