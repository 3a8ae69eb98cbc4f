"""Every NATS subject, JetStream stream, bucket and key name Cleave uses (placeholders in braces)."""

from __future__ import annotations

import re

PREFIX = "cleave"
TOKEN_CHARS = "A-Za-z0-9_-"  # what a name that is one subject token (and one KV key) may hold, as a regex class
MAX_WORKER_ID = 128
WORKER_ID_PATTERN = rf"^[{TOKEN_CHARS}]{{1,{MAX_WORKER_ID}}}$"
_NOT_TOKEN = re.compile(f"[^{TOKEN_CHARS}]")

SUBJECT_HEARTBEAT = PREFIX + ".hb.{worker_id}"  # worker -> scheduler: liveness and profile
SUBJECT_HEARTBEAT_ALL = PREFIX + ".hb.*"
SUBJECT_TILES = PREFIX + ".tile.{worker_id}"  # PS -> one worker: tiles to compute
SUBJECT_FANOUT = PREFIX + ".fan.{job}.{epoch}.{group}"  # PS -> every worker of a group: a shared input block
SUBJECT_CONTROL = PREFIX + ".ctl.{worker_id}"  # PS -> one worker (request/reply): join fan-out groups
SUBJECT_LINKCHECK = PREFIX + ".check.{worker_id}"  # PS -> a returning worker (request/reply): prove its downlink
# worker -> PS: finished blocks, on the worker's own subject (per-worker credentials may publish only there);
# the PS subscribes with worker_id="*" and checks that a message's worker_id is the subject's
SUBJECT_RESULTS = PREFIX + ".result.{job}.{epoch}.{worker_id}"
SUBJECT_ROUNDS = PREFIX + ".round.{worker_id}"  # PS -> one worker: train locally for a round (diloco, fedavg)
SUBJECT_ROUNDCAST = PREFIX + ".roundcast.{job}"  # PS -> every worker of a round at once: NATS fans it out
SUBJECT_ROUNDCAST_ALL = PREFIX + ".roundcast.*"  # what workers subscribe to
SUBJECT_UPDATES = PREFIX + ".update.{job}.{epoch}.{worker_id}"  # worker -> PS: a round's update, a split reply
SUBJECT_SPLIT = PREFIX + ".split.{worker_id}"  # PS -> the split-learning client: run a step's half
SUBJECT_SECAGG = PREFIX + ".secagg.{worker_id}"  # PS -> one member: a phase of secure aggregation (its replies
# travel in its round updates)
SUBJECT_PROBE = PREFIX + ".probe"  # an older worker's probes: not answered (they do not name their sender)
# worker -> scheduler (request/reply): latency and bandwidth probes, on the worker's own subject (per-worker
# credentials may publish only there); answered only on that worker's own inbox `_INBOX.worker.<id>.`
SUBJECT_PROBE_FROM = PREFIX + ".probe.{worker_id}"
SUBJECT_PROBE_ALL = PREFIX + ".probe.*"
# worker -> PS (request/reply): a part of a job's base weights or tokenizer (`ModelsGet`), on the worker's own
# subject (per-worker credentials may publish only there); answered only on that worker's own inbox
# `_INBOX.worker.<id>.`, by the PS that holds the object (the others stay silent)
SUBJECT_MODELS_GET = PREFIX + ".models.{worker_id}"
SUBJECT_MODELS_GET_ALL = PREFIX + ".models.*"
SUBJECT_OBSERVED = PREFIX + ".observed.{job}"  # PS -> scheduler: what the workers delivered (`Observed`)
SUBJECT_OBSERVED_ALL = PREFIX + ".observed.*"
# a request to a worker (the PS's fan-out joins and link checks) is answered on <inbox prefix>.w.<random>: a
# site's leaf node may publish there, and only there, among the PS's replies (cleave.auth, role "site")
WORKER_REPLY_TOKEN = "w"
# PS, scheduler -> monitor, `cleave status` (JetStream stream EVENTS_STREAM): an event or a step's metrics, filed
# under its kind and the job it names (NO_JOB: the fleet's), so that one job's are read, and deleted, by subject
SUBJECT_EVENTS = PREFIX + ".events.{kind}.{job}"
SUBJECT_EVENTS_ALL = PREFIX + ".events.>"
NO_JOB = "~fleet"  # SUBJECT_EVENTS's job of an event that names none (no job id can be it: ~ is no TOKEN_CHARS)
# submitter -> the hub's job runner: one job (JetStream stream JOBS_STREAM, kept until the runner takes it)
SUBJECT_JOB_SUBMIT = PREFIX + ".jobs.submit.{job}"
SUBJECT_JOB_SUBMIT_ALL = PREFIX + ".jobs.submit.*"

EVENTS_STREAM = "CLEAVE_EVENTS"
JOBS_STREAM = "CLEAVE_JOBS"  # submitted jobs, until the runner has recorded them in JOBS_BUCKET
JOBS_BUCKET = "cleave-jobs"  # key: job id -> JobRecord (the runner's queue, each job's state); written by the runner only
REGISTRY_BUCKET = "cleave-registry"  # key: worker id -> DeviceRecord; entries expire without heartbeats
PLAN_BUCKET = "cleave-plans"  # key: PLAN_KEY -> Plan
PLAN_KEY = "current"
SHAPES_KEY = "shapes"  # key in PLAN_BUCKET: the running job's JobShapes
REPLICA_PLAN_KEY = PLAN_KEY + ".r{replica}"  # key in PLAN_BUCKET: PS replica r's part of the fleet (--ps-replicas)
STATE_BUCKET = "cleave-state"  # PS persistence head records
STATE_OBJECTS = "cleave-state-objects"  # PS persistence tensors (Object Store)


def kv_stream(bucket: str) -> str:
    """The JetStream stream that holds key-value bucket `bucket` (nats-server's name for it)."""
    return f"KV_{bucket}"


def kv_subject(bucket: str, key: str = ">") -> str:
    """The subject of `key` in key-value bucket `bucket` (every key's: ">"; "" gives the bucket's prefix)."""
    return f"$KV.{bucket}.{key}"


def stream_purge(stream: str) -> str:
    """The JetStream API subject that purges `stream` (all of it, or what a filter names)."""
    return f"$JS.API.STREAM.PURGE.{stream}"


def obj_stream(bucket: str) -> str:
    """The JetStream stream that holds object-store bucket `bucket`."""
    return f"OBJ_{bucket}"


def token(name: str) -> str:
    """`name` with each character a subject token may not hold replaced by a -."""
    return _NOT_TOKEN.sub("-", name)
