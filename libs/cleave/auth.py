"""Per-role NATS credentials, the subject permissions each role gets, and a client's connect options.

Pure: everything here builds keys, permissions and option dicts; `cleave auth init` writes them to disk, and
`cleave_cli.serverconf` turns them into nats-server configs (with TLS). Every subject comes from
`cleave.schemas`, so a renamed subject or bucket changes the permissions with it.

Roles and what they may do (anything not listed is refused by nats-server):
- ps: publish tiles, fan-out blocks, joins and link checks, events and its own state (KV + Object Store), its
  job's GEMM shapes (the plans bucket's `shapes` key only) and what it observed of the workers; subscribe to
  results and to the workers' requests for its jobs' base weights and tokenizers (`cleave.models.*`), which it
  answers under the workers' inboxes (`_INBOX.worker.>`), only ever on the requester's own
  (`reply_refusal`). The hub's job runner logs in as the PS: it also takes submissions, writes the job
  records and finds and deletes a forgotten job's events in the events stream.
- scheduler: publish the registry and the plan (KV) and events; subscribe to heartbeats and to what the PS
  observed of the workers. Probes are answered by a credential of its own (`scheduler-probe`, its seed in
  scheduler.env beside the scheduler's), which may subscribe to probe requests and publish to the workers'
  inboxes (`_INBOX.worker.>`) and nowhere else: an answer aimed at a bucket or the JetStream API is refused
  by the server whatever a request names as its reply.
- monitor: reads the events stream, the registry, plan and job buckets, and live events; writes
  nothing (it may create the streams and buckets, as every service runs `Bus.setup()`).
- submitter: submit jobs to the hub (publish on `cleave.jobs.submit.*`, stored in JetStream), and read what
  `cleave status` and `cleave export` need: the job records, the events stream (step metrics), the PS's state
  and checkpoints. It writes nothing else (the runner alone writes the job records; a cancel or a forget is a
  submission, which the runner judges).
- site: a site's leaf node, dialling the hub (a leaf-node connection only, never a client): exactly what its
  workers may publish and receive (the worker role's subjects with `*` for the id), plus the answers to the
  PS's requests to them (`_INBOX.ps.w.>`, `cleave.schemas.WORKER_REPLY_TOKEN`: a leaf node cannot use
  `allow_responses`).
- worker: subscribe to its tiles, its control subject and the fan-out subjects (shared input blocks, which
  carry no secret of other workers: every worker may be sent any block), publish results, heartbeats, probe
  requests and requests for a job's base weights and tokenizer (`cleave.models.<id>`, answered by the PS),
  answer the PS's fan-out joins and link checks (`allow_responses`), read the replies to its requests; no
  JetStream at all. With `worker_id`, tiles, results, round updates, heartbeats, probes, model requests and
  their replies are pinned to that id (each on a per-worker subject); the shared worker credential gets a `*`
  (or `>`) in place of the id.
A `*` a role may subscribe to is one token: what lies below it is denied (`Permissions.subscribe_deny`).
Each role gets a private reply prefix `_INBOX.<role>` (`_INBOX.worker.<id>` for a worker), passed by
`connect_options`, so no role can read another's replies (JetStream API answers included).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any

import nkeys

from cleave.errors import ConfigError
from cleave.schemas import (
    EVENTS_STREAM,
    JOBS_BUCKET,
    JOBS_STREAM,
    PLAN_BUCKET,
    REGISTRY_BUCKET,
    SHAPES_KEY,
    STATE_BUCKET,
    STATE_OBJECTS,
    SUBJECT_CONTROL,
    SUBJECT_EVENTS_ALL,
    SUBJECT_FANOUT,
    SUBJECT_HEARTBEAT,
    SUBJECT_JOB_SUBMIT_ALL,
    SUBJECT_LINKCHECK,
    SUBJECT_MODELS_GET,
    SUBJECT_MODELS_GET_ALL,
    SUBJECT_OBSERVED,
    SUBJECT_OBSERVED_ALL,
    SUBJECT_PROBE_ALL,
    SUBJECT_PROBE_FROM,
    SUBJECT_RESULTS,
    SUBJECT_ROUNDCAST_ALL,
    SUBJECT_ROUNDS,
    SUBJECT_SECAGG,
    SUBJECT_SPLIT,
    SUBJECT_TILES,
    SUBJECT_UPDATES,
    WORKER_REPLY_TOKEN,
)
from cleave.schemas.subjects import kv_stream, kv_subject, obj_stream, stream_purge

ROLES = ("ps", "scheduler", "monitor", "worker", "submitter", "site")
PROBE_ECHO = "scheduler-probe"  # the scheduler's second credential: it answers probes and may do nothing else
PROBE_ECHO_ENV = "CLEAVE_SCHEDULER_PROBE_NKEY_SEED"  # its seed, in scheduler.env
ADMIN = "admin"  # operators' credential for the `nats` CLI: unrestricted, never given to a service
SERVICE_ROLES = ("ps", "scheduler", "monitor")  # the trusted side; workers may be strangers' machines
SUBMITTER = "submitter"  # submits, watches and exports jobs (`cleave submit|status|export`)
SITE = "site"  # a site's leaf node (`cleave site`); its name is the site's
INBOX_ROOT = "_INBOX"
WORKER_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def _wild(pattern: str) -> str:
    """A subject pattern with every `{field}` replaced by `*`, e.g. cleave.result.*.*"""
    parts = [("*" if p.startswith("{") and p.endswith("}") else p) for p in pattern.split(".")]
    return ".".join(parts)


# Streams every service's `Bus.setup()` creates when missing (the PS also creates its Object Store).
SETUP_STREAMS = (EVENTS_STREAM, kv_stream(REGISTRY_BUCKET), kv_stream(PLAN_BUCKET), kv_stream(STATE_BUCKET))


# ---- permissions -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False  # may answer a request it received, once (probes)

    @property
    def subscribe_deny(self) -> tuple[str, ...]:
        """What lies below each subscribe pattern that ends in `*`. nats-server admits a subscription to a
        literal `>` there (`cleave.roundcast.>` where `cleave.roundcast.*` is allowed) and would deliver it
        deeper subjects too; denying them keeps each `*` to one token."""
        return tuple(f"{s}.>" for s in self.subscribe if s.endswith(".*"))


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
    return [kv_subject(bucket), stream_purge(kv_stream(bucket))]


def _obj_write(bucket: str) -> list[str]:
    return [f"$O.{bucket}.>", stream_purge(obj_stream(bucket))]


def _service(role: str, publish: list[str], subscribe: list[str], allow_responses: bool = False) -> Permissions:
    common = ["$JS.API.INFO", "$JS.API.STREAM.NAMES"]
    return Permissions(tuple(dict.fromkeys(common + publish)),
                       tuple(dict.fromkeys([f"{inbox_prefix(role)}.>", *subscribe])), allow_responses)


def permissions(role: str, worker_id: str | None = None) -> Permissions:
    """The subjects one role may publish and subscribe to (see the module docstring)."""
    if role == "ps":
        pub = [_wild(SUBJECT_TILES), _wild(SUBJECT_FANOUT), _wild(SUBJECT_CONTROL), _wild(SUBJECT_LINKCHECK),
               _wild(SUBJECT_ROUNDS), _wild(SUBJECT_SECAGG), _wild(SUBJECT_OBSERVED),
               SUBJECT_ROUNDCAST_ALL, _wild(SUBJECT_SPLIT), SUBJECT_EVENTS_ALL,
               *_kv_write(STATE_BUCKET), *_obj_write(STATE_OBJECTS),
               f"{inbox_prefix('worker')}.>"]  # its answers to the workers' model requests (`reply_refusal`)
        for s in (*SETUP_STREAMS, obj_stream(STATE_OBJECTS)):
            pub += _js_create(s)
        for s in (kv_stream(PLAN_BUCKET), kv_stream(REGISTRY_BUCKET), kv_stream(STATE_BUCKET),
                  obj_stream(STATE_OBJECTS)):
            pub += _js_read(s)
        # the hub's job runner runs as the PS: it takes submitted jobs and keeps their records
        for s in (JOBS_STREAM, kv_stream(JOBS_BUCKET)):
            pub += [*_js_create(s), *_js_read(s)]
        pub += [*_kv_write(JOBS_BUCKET), kv_subject(PLAN_BUCKET, SHAPES_KEY)]  # and its job's GEMM shapes, planned
        pub += [*_js_read(EVENTS_STREAM), stream_purge(EVENTS_STREAM)]  # and a forgotten job's events
        return _service(role, pub, [_wild(SUBJECT_RESULTS), _wild(SUBJECT_UPDATES), SUBJECT_MODELS_GET_ALL])
    if role == SUBMITTER:  # submits jobs; reads their records, metrics and checkpoints; writes nothing else
        pub = [SUBJECT_JOB_SUBMIT_ALL, f"$JS.API.STREAM.INFO.{JOBS_STREAM}"]
        for s in (kv_stream(JOBS_BUCKET), EVENTS_STREAM, kv_stream(STATE_BUCKET), obj_stream(STATE_OBJECTS)):
            pub += _js_read(s)
        return _service(role, pub, [])
    if role == "scheduler":
        pub = [SUBJECT_EVENTS_ALL, *_kv_write(REGISTRY_BUCKET), *_kv_write(PLAN_BUCKET)]
        for s in SETUP_STREAMS:
            pub += _js_create(s)
        for s in (kv_stream(PLAN_BUCKET), kv_stream(REGISTRY_BUCKET)):
            pub += _js_read(s)
        return _service(role, pub, [_wild(SUBJECT_HEARTBEAT), SUBJECT_OBSERVED_ALL])
    if role == "monitor":  # writes nothing; may create the streams because it runs Bus.setup() too
        pub = []
        for s in SETUP_STREAMS:
            pub += _js_create(s)
        for s in (EVENTS_STREAM, kv_stream(PLAN_BUCKET), kv_stream(REGISTRY_BUCKET)):
            pub += _js_read(s)
        pub += [*_js_create(kv_stream(JOBS_BUCKET)), *_js_read(kv_stream(JOBS_BUCKET))]  # the hub's jobs, on the dashboard
        return _service(role, pub, [SUBJECT_EVENTS_ALL])  # (no heartbeats: the registry tells it the fleet)
    if role == "worker":
        wid = "*" if worker_id is None else check_worker_id(worker_id)
        inbox = f"{inbox_prefix(role)}.>" if worker_id is None else f"{inbox_prefix(role, worker_id)}.>"
        return Permissions(
            publish=(SUBJECT_RESULTS.format(job="*", epoch="*", worker_id=wid),
                     SUBJECT_UPDATES.format(job="*", epoch="*", worker_id=wid), SUBJECT_HEARTBEAT.format(worker_id=wid),
                     SUBJECT_PROBE_FROM.format(worker_id=wid), SUBJECT_MODELS_GET.format(worker_id=wid)),
            subscribe=(SUBJECT_TILES.format(worker_id=wid), _wild(SUBJECT_FANOUT), SUBJECT_CONTROL.format(worker_id=wid),
                       SUBJECT_LINKCHECK.format(worker_id=wid),
                       SUBJECT_ROUNDS.format(worker_id=wid), SUBJECT_ROUNDCAST_ALL, SUBJECT_SPLIT.format(worker_id=wid),
                       SUBJECT_SECAGG.format(worker_id=wid),
                       inbox),
            allow_responses=True,  # its answers to the PS's fan-out joins and link checks
        )
    if role == SITE:  # one leaf link carries every worker of the site: the shared worker's subjects, and
        worker = permissions("worker")  # the answers to the PS's joins and link checks (no allow_responses
        replies = f"{inbox_prefix('ps')}.{WORKER_REPLY_TOKEN}.>"  # across a leaf node: measured)
        return Permissions(publish=(*worker.publish, replies), subscribe=worker.subscribe)
    raise ConfigError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")


def probe_permissions() -> Permissions:
    """The probe echo's credential (`PROBE_ECHO`): probe requests in, answers to the workers' inboxes only."""
    return Permissions(publish=(f"{inbox_prefix('worker')}.>",), subscribe=(SUBJECT_PROBE_ALL,))


def requester(pattern: str, subject: str) -> str:
    """The worker id that `subject` names where `pattern` (e.g. `SUBJECT_PROBE_FROM`) ends in `{worker_id}`
    ('' when it names none)."""
    prefix = pattern.split("{", 1)[0]
    worker = subject[len(prefix):] if subject.startswith(prefix) else ""
    return "" if any(c in worker for c in ".*>") else worker


def reply_refusal(pattern: str, subject: str, reply: str) -> str:
    """Why a worker's request on `subject` (a `pattern` ending in `{worker_id}`) must not be answered on
    `reply` ('' when it may). A request names its own reply subject and the answer goes out with the
    answering connection's rights, so it goes only under the requester's own inbox `_INBOX.worker.<id>.`: the
    only one its credential may read, and where no bucket, stream or service listens."""
    worker = requester(pattern, subject)
    if not worker:
        return "no worker id in the subject"
    own = inbox_prefix("worker", worker) + "."
    if not reply.startswith(own) or len(reply) == len(own) or "*" in reply or ">" in reply:
        return f"reply is not {worker}'s own inbox"
    return ""


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
            return PROBE_ECHO_ENV
        return f"CLEAVE_{self.role.upper()}_NATS_NKEY_SEED"


def new_credential(role: str, worker_id: str | None = None) -> Credential:
    seed, _ = _nkey()
    name = role if worker_id is None else f"{role}-{worker_id}"
    return credential_from_seed(name, role, seed, worker_id, _nkey()[0] if role == "scheduler" else None)


def _nkey() -> tuple[str, str]:
    """A new user nkey: (seed, public key)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode(), nkeys.from_seed(bytearray(seed)).public_key.decode()


def credential_from_seed(name: str, role: str, seed: str, worker_id: str | None = None,
                         probe_seed: str | None = None) -> Credential:
    """The credential a seed stands for (its public key derived again), e.g. as read back from `<name>.env`;
    a scheduler's with its probe echo (`probe_seed`, `PROBE_ECHO`) when it has one."""
    public = _public(name, seed)
    perms = permissions(role, worker_id) if role != SITE else permissions(SITE)
    companions = ()
    if role == "scheduler" and probe_seed:
        companions = (Credential(PROBE_ECHO, role, probe_seed, _public(PROBE_ECHO, probe_seed), probe_permissions()),)
    return Credential(name, role, seed, public, perms, companions)


def user_seed(name: str, seed: str) -> str:
    """`seed` if it is a well-formed NATS user seed, else ConfigError naming the setting `name` (nats-py retries
    a malformed one for ever)."""
    if not seed.startswith("SU"):
        raise ConfigError(f"{name} is not a NATS user seed (it starts with SU)")
    _public(name, seed)
    return seed


def _public(name: str, seed: str) -> str:
    try:
        return nkeys.from_seed(bytearray(seed.encode())).public_key.decode()
    except Exception:  # nkeys raises its own errors for a malformed seed
        raise ConfigError(f"{name}: not a NATS user seed") from None


def site_credential(site: str) -> Credential:
    """The leaf-node credential of site `site` (`cleave auth init --sites`)."""
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return credential_from_seed(f"{SITE}-{check_site_name(site)}", SITE, seed.decode())


def check_site_name(name: str) -> str:
    """A site name is used in file, process and server names: letters, digits, '-' and '_' only."""
    if not 0 < len(name) <= 64 or not set(name) <= WORKER_ID_CHARS:
        raise ConfigError(f"site name {name!r}: use 1-64 of A-Z a-z 0-9 _ - (--sites, --name)")
    return name


def admin_credential(seed: str | None = None) -> Credential:
    """The operators' unrestricted credential: a new one, or the one `seed` (admin.nk) stands for."""
    seed = seed or nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    public = nkeys.from_seed(bytearray(seed.encode())).public_key.decode()
    return Credential(ADMIN, ADMIN, seed, public, Permissions(publish=(">",), subscribe=(">",)))


def credentials(worker_ids: tuple[str, ...] = ()) -> list[Credential]:
    """One credential per service role, the submitter's, and either one shared worker credential or one per
    worker id."""
    creds = [new_credential(r) for r in (*SERVICE_ROLES, SUBMITTER)]
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
    password = _secret(getattr(settings, "nats_password", None))
    if seed:
        opts["nkeys_seed_str"] = user_seed(f"CLEAVE_{role.upper()}_NATS_NKEY_SEED", seed)
    elif user:
        opts["user"], opts["password"] = user, password
    elif password:
        raise ConfigError(f"CLEAVE_{role.upper()}_NATS_PASSWORD is set without CLEAVE_{role.upper()}_NATS_USER: "
                          "a password logs in only with its user")
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
