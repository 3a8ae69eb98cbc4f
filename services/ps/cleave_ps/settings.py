"""Parameter-server settings, from CLEAVE_PS_* environment variables or `cleave ps` flags."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from cleave.bus.urls import NatsUrl
from cleave.gemm.dealer.model import DEFAULT_COPY_SHARE
from cleave.gemm.ledger import DEFAULT_DEFERRED, DEFAULT_WINDOW, MAX_WINDOW
from cleave.runtime.config_file import FileSettings
from cleave.runtime.faults import PS_POINTS, spec_type
from cleave.runtime.memory import DEFAULT_PRODUCT_POOL_BYTES

FailAt = spec_type(PS_POINTS)  # fail_at's points: a typo is refused, not a fault that never fires


class PsSettings(FileSettings):
    config_table: ClassVar[str] = "ps"  # its table of the settings file (cleave.runtime.config_file)
    model_config = SettingsConfigDict(env_prefix="CLEAVE_PS_", extra="ignore")

    nats_url: NatsUrl = "nats://127.0.0.1:4222"
    job_file: Path | None = None  # JSON JobConfig; None = the default job
    metrics_out: Path | None = None  # JSON lines, one per step
    window: int = Field(DEFAULT_WINDOW, ge=1, le=MAX_WINDOW)  # tiles in flight per worker (a planned block's pieces: the plan's chunks)
    tile_timeout_s: float = Field(1.0, gt=0)  # a worker silent this long with tiles in flight is presumed lost
    timeout_factor: float = Field(4.0, ge=1)  # ... or this many times its usual tile round trip, if longer
    speculate_factor: float = Field(3.0, ge=0)  # copy a tile running this many usual round trips; 0 = never
    speculate_min_s: float = Field(0.2, ge=0)  # ... and at least this long
    copy_share: float = Field(DEFAULT_COPY_SHARE, ge=0)  # ... while a GEMM's copies sent at most this share of its other bytes
    tile_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # bf16/fp16: an approximate mode, half the downlink
    verify_fraction: float = Field(0.0, ge=0, le=1)  # tiles also computed by a second worker, to catch liars
    freivalds: bool = True  # check every result block as the product of its inputs (Freivalds' check) before use
    tick_s: float = Field(0.05, gt=0)  # how often deadlines are checked
    fanout: bool = True  # publish an input block several planned workers need once, to their group subject
    deferred_gemms: int = Field(DEFAULT_DEFERRED, ge=0)  # weight gradients dealt beside the backward's later GEMMs; 0: one GEMM at a time
    gemm_timeout_s: float = Field(3600.0, gt=0)  # a GEMM not done by then aborts the step (nothing applied)
    max_inflight_bytes: int = Field(48 * 1024 * 1024, ge=0)  # input bytes in flight to one worker past its
    # first tile (and no more than 2 s of its downlink): under nats-server's max_pending (64 MiB); 0 = no limit
    max_result_bytes: int = Field(64 * 1024 * 1024, ge=1024 * 1024)  # larger results are refused on receipt
    # (at least 1 MiB: a 512 x 512 float32 block; under the blocks the plan deals, no step could end)
    max_pending_bytes: int = Field(256 * 1024 * 1024, gt=0)  # results queued unread; a flood past it is dropped
    memory_bytes: int = Field(0, ge=0)  # what the PS may use (preflight); 0: the machine's available memory
    product_pool_bytes: int = Field(DEFAULT_PRODUCT_POOL_BYTES, ge=0)  # freed GEMM outputs of 1 MiB or more kept
    # resident for outputs of their shape (cleave_ps.fleet.products: no fresh pages to zero); the preflight counts them
    state_max_bytes: int = Field(0, ge=0)  # the checkpoint store's size limit where the PS creates it; 0: JetStream's
    persist_every: int = Field(0, ge=0)  # commit the state every k steps; 0: when it costs <= 5% of training time
    checkpoint_staging: Literal["off", "auto"] = "off"  # auto: stream a host copy while training goes on, when
    # it takes at most half the free memory (a copy of the weights and optimizer: not the memory-light default)
    fail_at: FailAt = ""  # fault injection: "before_commit:3", "after_commit:3", "in_step:3", "in_round:3"
    fault_dir: Path | None = None  # with fail_at: remember fired faults here so each fires once
    threads: int = Field(0, ge=0, le=1024)  # torch threads on the PS; 0 = torch's default
    replicas: int = Field(1, ge=1, le=64)  # PS replicas of the job (cleave_ps.jobs.replicas); each trains a share
    replica: int = Field(0, ge=0)  # this one's index, 0..replicas-1; replica 0 hosts the rendezvous and commits
    replica_addr: str = Field("127.0.0.1", min_length=1)  # where replica 0 listens for the others (torchrun's MASTER_ADDR)
    replica_port: int = Field(29500, ge=1, le=65535)  # ... and its port (MASTER_PORT)
    replica_join_timeout_s: float = Field(60.0, gt=0)  # reach the others within this, or exit non-zero
    replica_step_timeout_s: float = Field(1800.0, gt=0)  # a collective waiting longer than this fails
    fail_replica: int = Field(-1, ge=-1)  # with replicas > 1: only this replica fires fail_at (-1: each one)
    nats_user: str = ""  # user/password login, for a NATS you run yourself; `cleave auth init` issues nkeys
    nats_password: SecretStr = SecretStr("")
    nats_nkey_seed: SecretStr = SecretStr("")  # this role's seed from `cleave auth init` (<role>.env)
    nats_tls_ca: Path | None = None  # CA of the NATS server's certificate; None = the system's trust store

    @model_validator(mode="after")
    def _replicas(self) -> PsSettings:
        if self.replica >= self.replicas or self.fail_replica >= self.replicas:
            raise ValueError(f"replica={self.replica} and fail_replica={self.fail_replica} must be below "
                             f"replicas={self.replicas} (replicas are numbered from 0)")
        return self
