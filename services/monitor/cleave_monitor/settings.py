"""Monitor settings, from CLEAVE_MONITOR_* environment variables or `cleave monitor` flags."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import SettingsConfigDict

from cleave.bus.urls import NatsUrl
from cleave.runtime.config_file import FileSettings

DEFAULT_PORT = 8787  # fixed, so compose and bookmarks know where to look; 0 = any free port
MIN_TOKEN_CHARS = 16  # a token given: the one made up has 32 (`guard.new_token`)


class MonitorSettings(FileSettings):
    config_table: ClassVar[str] = "monitor"  # its table of the settings file (cleave.runtime.config_file)
    model_config = SettingsConfigDict(env_prefix="CLEAVE_MONITOR_", extra="ignore")

    nats_url: NatsUrl = "nats://127.0.0.1:4222"
    host: str = "127.0.0.1"  # 0.0.0.0 under compose, to publish the port: then with a token
    token: SecretStr = SecretStr("")  # asked for beyond localhost; empty there: one is made up and logged
    allowed_hosts: str = ""  # comma-separated Host names answered besides localhost (behind a proxy: its name)
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    url_file: Path | None = None  # once serving, the dashboard URL is written here (for supervisors)
    max_points: int = Field(20_000, ge=10)  # steps kept per job (older ones are dropped first)
    max_events: int = Field(10_000, ge=10)  # events kept for the timeline
    stale_s: float = Field(6.0, gt=0)  # a registry entry not refreshed this long shows as stale
    status_every_s: float = Field(1.0, gt=0)  # fleet/plan/totals pushed to live pages at most this often
    keepalive_s: float = Field(15.0, gt=0)  # SSE comment sent on an idle stream
    fleet_rows: int = Field(500, ge=1)  # devices listed in the fleet view (the busiest first)
    nats_user: str = ""  # user/password login, for a NATS you run yourself; `cleave auth init` issues nkeys
    nats_password: SecretStr = SecretStr("")
    nats_nkey_seed: SecretStr = SecretStr("")  # this role's seed from `cleave auth init` (<role>.env)
    nats_tls_ca: Path | None = None  # CA of the NATS server's certificate; None = the system's trust store

    @field_validator("token")
    @classmethod
    def _unguessable(cls, token: SecretStr) -> SecretStr:
        if 0 < len(token.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(f"a token shorter than {MIN_TOKEN_CHARS} characters could be guessed, and it opens the "
                             "dashboard to whoever can reach it: use a longer one (`python -c 'import secrets; "
                             "print(secrets.token_urlsafe(24))'`), or leave it empty to have one made up and logged")
        return token

    @field_validator("url_file")
    @classmethod
    def _a_file(cls, path: Path | None) -> Path | None:
        if path is not None and path.is_dir():
            raise ValueError(f"{path} is a folder; the dashboard's URL is written to a file (e.g. {path}/monitor.url)")
        return path
