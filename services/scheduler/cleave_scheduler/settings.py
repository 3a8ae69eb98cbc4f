"""Scheduler settings, from CLEAVE_SCHEDULER_* environment variables."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from cleave.bus.urls import NatsUrl
from cleave.gemm.tiles import DEFAULT_CHUNKS, DEFAULT_TILE
from cleave.runtime.config_file import FileSettings
from cleave_scheduler.probes import DEFAULT_TOTAL_BURST_BYTES, DEFAULT_TOTAL_RATE_BYTES_PER_S


class SchedulerSettings(FileSettings):
    config_table: ClassVar[str] = "scheduler"  # its table of the settings file (cleave.runtime.config_file)
    model_config = SettingsConfigDict(env_prefix="CLEAVE_SCHEDULER_", extra="ignore")

    nats_url: NatsUrl = "nats://127.0.0.1:4222"
    liveness_s: float = Field(1.0, gt=0)  # a worker silent this long has left
    sweep_s: float = Field(0.1, gt=0)  # how often liveness is checked
    tile_rows: int = Field(DEFAULT_TILE, gt=0)  # the largest block sent as one tile (planned blocks are cut to it)
    tile_cols: int = Field(DEFAULT_TILE, gt=0)  # 1024 measured 1.4x faster than 256 on the emulated fleet
    chunks: int = Field(DEFAULT_CHUNKS, ge=1, le=64)  # a planned block goes out in >= this many pieces, so that a device
    # computes one while the next arrives and the last leaves (1: whole blocks, no overlap within a block)
    planner: Literal["cost", "even", "uniform"] = "cost"  # cost-aware blocks, even blocks, or a tile queue
    ps_bandwidth: float | None = Field(None, gt=0)  # the PS's egress, bytes/s, for the planner (None: unlimited)
    registry_refresh_s: float = Field(2.0, gt=0)  # rewrite a live worker's registry entry this often
    echo_burst_bytes: int = Field(DEFAULT_TOTAL_BURST_BYTES, gt=0)  # probe echo bytes all workers may draw at once
    echo_bytes_per_s: float = Field(DEFAULT_TOTAL_RATE_BYTES_PER_S, gt=0)  # ... and per second after (probes.py)
    nats_user: str = ""  # user/password login, for a NATS you run yourself; `cleave auth init` issues nkeys
    nats_password: SecretStr = SecretStr("")
    nats_nkey_seed: SecretStr = SecretStr("")  # this role's seed from `cleave auth init` (<role>.env)
    probe_nkey_seed: SecretStr = SecretStr("")  # the seed probes are answered with (scheduler.env has both)
    nats_tls_ca: Path | None = None  # CA of the NATS server's certificate; None = the system's trust store
