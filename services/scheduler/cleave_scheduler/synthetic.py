"""The scheduler's real planning path without heartbeats: a registry of synthetic devices and a job's shapes
(for tests, benchmarks and load tools that need a plan for thousands of devices in seconds)."""

from __future__ import annotations

import time

from cleave.models import StepLayout, gemm_shapes, get_preset
from cleave.plan.fleet import synthetic_fleet
from cleave.schemas import DeviceRecord, GemmSpec, JobShapes, Plan
from cleave_scheduler.planning import with_layouts
from cleave_scheduler.registry import Registry

CACHE_BYTES = 128 * 1024 * 1024  # the worker's default block cache


def synthetic_registry(devices: int, seed: int = 0) -> Registry:
    """A scheduler registry holding `devices` synthetic edge devices, as if each had sent a heartbeat."""
    reg = Registry(liveness_s=1.0)
    now = time.time()
    for d in synthetic_fleet(devices, seed).devices():
        reg.devices[d.id] = DeviceRecord(worker_id=d.id, profile=d.profile, first_seen=now, last_seen=now,
                                         cache_bytes=CACHE_BYTES)
    return reg


def job_shapes(model: str, batch: int, seq: int, dtype_bytes: int) -> JobShapes:
    """What a PS running this job tells the scheduler (its step as `JobConfig.layout` has it by default)."""
    cfg = get_preset(model)
    specs = tuple(GemmSpec(name=g.name, m=g.m, n=g.n, k=g.k, count_per_step=g.count_per_step)
                  for g in gemm_shapes(cfg, batch, seq, StepLayout.of(cfg, batch * seq)))
    return JobShapes(job=f"{model}-b{batch}", gemms=specs, dtype_bytes=dtype_bytes)


def scheduler_plan(reg: Registry, shapes: JobShapes, planner: str = "cost") -> Plan:
    """The plan the scheduler publishes for this registry and job (its default tile and chunk settings)."""
    return with_layouts(reg.plan(time.time(), 1024, 1024, "start", 4), shapes, planner, None)
