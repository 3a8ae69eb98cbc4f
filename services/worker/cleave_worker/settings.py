"""Worker settings, from CLEAVE_WORKER_* environment variables or command-line flags."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import ClassVar

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from cleave.bus.urls import NatsUrl
from cleave.runtime.config_file import FileSettings
from cleave.runtime.faults import WORKER_POINTS, spec_type
from cleave.schemas.fleet import MAX_MEMORY_BYTES
from cleave.schemas.subjects import WORKER_ID_PATTERN, token


def default_worker_id() -> str:
    host = token(socket.gethostname())[:40]
    return f"{host}-{os.getpid()}"


FailAt = spec_type(WORKER_POINTS)  # fail_at's points: a typo is refused, not a fault that never fires


class WorkerSettings(FileSettings):
    config_table: ClassVar[str] = "worker"  # its table of the settings file (cleave.runtime.config_file)
    model_config = SettingsConfigDict(env_prefix="CLEAVE_WORKER_", extra="ignore", populate_by_name=True)

    nats_url: NatsUrl = "nats://127.0.0.1:4222"
    worker_id: str = Field(default_factory=default_worker_id, pattern=WORKER_ID_PATTERN,
                           validation_alias=AliasChoices("CLEAVE_WORKER_ID", "CLEAVE_WORKER_WORKER_ID"))
    # (the environment's CLEAVE_WORKER_ID; CLEAVE_WORKER_WORKER_ID, its first spelling, is read too)
    memory_bytes: int = Field(512 * 1024 * 1024, gt=0, le=MAX_MEMORY_BYTES)  # budget for a tile's inputs and output
    cache_bytes: int = Field(128 * 1024 * 1024, ge=0, le=MAX_MEMORY_BYTES)  # input blocks kept for reuse (besides
    # the budget: docs/security.md)
    heartbeat_s: float = Field(0.25, gt=0)
    threads: int = Field(1, ge=1, le=1024)  # torch intra-op threads for the GEMMs
    profile: str = ""  # declared device, "flops=..,down=..,up=..,latency=..,memory=..": the worker paces itself
    probe_every_s: float = Field(60.0, gt=0)  # re-measure the links this often (measured profiles only)
    data: str | None = None  # this client's own data source (a data spec): it trains the round methods and split
    # learning on it, declares only its size, never its path or content; None = the job's data
    model_cache: Path = Path("~/.cache/cleave/models")  # base weights and tokenizers fetched from the PS, by hash
    round_memory_bytes: int = Field(0, ge=0)  # what a round's model, optimizer and activations may take; 0: the
    # machine's available memory. A job that needs more is refused with the numbers, before anything is built
    lie_weight: float = 0.0  # testing knob: claim this aggregation weight in every round update (a lying member)
    corrupt: float = 0.0  # testing knob: add this to one element of every block (a lying worker)
    fail_at: FailAt = ""  # fault injection for tests: "tile:3" dies on receiving the first tile of step 3
    fault_dir: Path | None = None  # with fail_at: remember fired faults here so each fires once
    nats_user: str = ""  # user/password login, for a NATS you run yourself; `cleave auth init` issues nkeys
    nats_password: SecretStr = SecretStr("")
    nats_nkey_seed: SecretStr = SecretStr("")  # this role's seed from `cleave auth init` (<role>.env)
    nats_tls_ca: Path | None = None  # CA of the NATS server's certificate; None = the system's trust store

    @field_validator("model_cache")
    @classmethod
    def _a_folder(cls, path: Path) -> Path:
        if path.expanduser().exists() and not path.expanduser().is_dir():
            raise ValueError(f"{path} is not a folder (the cache of base weights and tokenizers is one)")
        return path
