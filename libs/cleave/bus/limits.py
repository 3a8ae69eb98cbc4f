"""The limits Cleave sets on the bus: the nats-server settings every config it ships carries, and the size of
every stream and KV bucket it creates."""

from cleave.schemas import MAX_CONTROL_BYTES, MAX_PLAN_FRAME_BYTES, PLAN_BUCKET, REGISTRY_BUCKET, STATE_BUCKET

HEADROOM = 4096  # bytes of max_payload kept free for headers the client may add
# Slow consumers, in every nats-server config we ship (docs/operations.md): the server cuts off a client with
# more than max_pending bytes waiting for it, or whose socket takes longer than write_deadline for one write.
# The PS keeps at most 48 MiB and 2 s of a worker's measured downlink in flight to it (PsSettings
# max_inflight_bytes, cleave.gemm.dealer DEFAULT_INFLIGHT_S): below both, with a 10x margin on the deadline.
SERVER_MAX_PENDING = 64 * 1024 * 1024
SERVER_WRITE_DEADLINE_S = 20
SERVER_LIMITS = f'max_pending: {SERVER_MAX_PENDING}\nwrite_deadline: "{SERVER_WRITE_DEADLINE_S}s"'
MiB = 1024 * 1024
# Every stream and bucket is created with a size limit and a largest value (a bucket that is full refuses new
# writes; the events stream drops its oldest). (largest value, largest total) in bytes:
BUCKET_LIMITS = {
    REGISTRY_BUCKET: (64 * 1024, 64 * MiB),  # a DeviceRecord is ~300 bytes: 10,000 workers take ~3 MB
    PLAN_BUCKET: (MAX_PLAN_FRAME_BYTES, 1024 * MiB),  # a 10,000-device plan's frame is < 1 MB; 5 revisions a key
    STATE_BUCKET: (MAX_CONTROL_BYTES + HEADROOM, 1024 * MiB),  # heads and epochs (a head is <= MAX_CONTROL_BYTES)
}
DEFAULT_BUCKET_LIMITS = (MAX_CONTROL_BYTES, 256 * MiB)  # any other bucket
EVENTS_MAX_BYTES = 256 * MiB  # the events stream keeps its newest events within this
JOBS_MAX_BYTES = 64 * MiB  # the hub's job queue (submissions the runner has not taken): full, it refuses new
# ones (discard new) rather than drop a waiting job; a job file is a few KiB
STORE_FAILED = 10077  # JetStream's err_code for a message its stream refuses to store (full, or too large)
