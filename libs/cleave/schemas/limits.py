"""Size limits of messages and of what they may declare: every decoder checks against these."""

from __future__ import annotations

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # any reassembled message
MAX_CONTROL_BYTES = 1024 * 1024  # heartbeats, events, job shapes
MAX_PLAN_BYTES = 32 * 1024 * 1024  # a plan once decompressed (10,000 devices: ~3.5 MB; its frame stays < 1 MB)
MAX_PLAN_FRAME_BYTES = 8 * 1024 * 1024  # a plan's frame as stored in the plans bucket (one NATS message)
MAX_TENSOR_ELEMENTS = 1 << 28
MAX_GEMM_DIM = 1 << 31  # m, n or k of a planned GEMM (box coordinates travel as int32)
MAX_PROBE_BYTES = 4 * 1024 * 1024
MAX_BLOCK_PARTS = 256  # segments of one input block (`cleave.gemm.fanout.parts` sends a block needing more whole)
MAX_LINKCHECK_BYTES = 1024 * 1024
MAX_ROUND_WORKERS = 100_000  # workers named in one broadcast round
MAX_PS_REPLICAS = 64  # PS replicas of one job (JobShapes.replicas)
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # a checkpoint's manifest object
MAX_MODELS_PART_BYTES = 64 * 1024 * 1024  # bytes of a bundle's object in one answer (nats-server's largest max_payload)
MAX_JOB_BYTES = 64 * 1024  # a submitted job's description (its JobConfig as JSON)
MAX_REASON_CHARS = 4096  # a job record's reason (why it failed or was cancelled) and its verdict's
