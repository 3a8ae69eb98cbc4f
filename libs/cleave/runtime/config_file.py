"""One settings file for a job and the services that run it.

A TOML file (`cleave.toml`): its top-level keys are the job's settings (`cleave.train.job.JobConfig`), and its
tables `[ps]`, `[worker]`, `[scheduler]` and `[monitor]` the services' (the fields of their settings classes,
without the `CLEAVE_<SERVICE>_` prefix):

    preset = "small"
    steps = 200
    batch_size = 8

    [ps]
    persist_every = 10

    [worker]
    threads = 2

The job reads it with `cleave train --config FILE` (or `cleave submit`, `cleave ps --config`); a service reads
its table from the file named by `CLEAVE_CONFIG` (or its `--config` flag). Precedence, highest first: command-line
flags, environment variables (`CLEAVE_PS_PERSIST_EVERY=...`), the file, the defaults. A JSON job file (the job's
keys only) is read too. Errors name the file and the key.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from cleave.errors import ConfigError

CONFIG_ENV = "CLEAVE_CONFIG"  # the settings file a service reads its table from
SERVICE_TABLES = ("ps", "worker", "scheduler", "monitor")


def read(path: str | Path) -> dict[str, Any]:
    """The file's settings as a dict: TOML (by default) or JSON (a `.json` file)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read settings file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a settings file is UTF-8 TOML or JSON)") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of settings, got {type(data).__name__}")
    return data


def job_settings(path: str | Path) -> dict[str, Any]:
    """The job's part of a settings file: everything but the services' tables."""
    return {k: v for k, v in read(path).items() if k not in SERVICE_TABLES}


def service_table(path: str | Path, table: str, fields: Mapping[str, FieldInfo]) -> dict[str, Any]:
    """A service's table of the file; an unknown key is an error naming it (a typo would silently do nothing),
    and so is a value of the wrong TOML type (`heartbeat_s = true` is not 1.0, `threads = 2.0` not 2; an
    environment variable, always a string, is converted as pydantic does)."""
    values = read(path).get(table, {})
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: [{table}] must be a table of settings")
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{path}: unknown setting{'s' if len(unknown) > 1 else ''} in [{table}]: "
                          f"{', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    for key, value in values.items():
        try:  # strict as JSON is: a string for a path, an integer for a float, and nothing else converted
            text = json.dumps(value)
            TypeAdapter(fields[key].annotation).validate_json(text, strict=True)
        except TypeError:  # a TOML date or time
            raise ConfigError(f"{path}: [{table}] {key} = {value}: not a number, string or boolean") from None
        except ValidationError as e:
            raise ConfigError(f"{path}: [{table}] {key} = {text}: {e.errors()[0]['msg']}") from None
    return values


def validation_message(e: ValidationError, where: str) -> str:
    """The first error of a pydantic validation, naming its key and where the value came from."""
    first = e.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    return f"{where}: invalid setting {key}: {msg}" if key else f"{where}: {msg}"


def unknown_variables(settings: type[BaseSettings], environ: Mapping[str, str]) -> list[str]:
    """The variables of `environ` with the settings' prefix that name none of its fields (nor their aliases)."""
    prefix = settings.model_config.get("env_prefix", "").upper()
    if not prefix:
        return []
    known = {prefix + name.upper() for name in settings.model_fields}
    for field in settings.model_fields.values():
        alias = field.validation_alias
        known.update(a.upper() for a in getattr(alias, "choices", [alias]) if isinstance(a, str))
    return sorted(k for k in environ if k.upper().startswith(prefix) and k.upper() not in known)


class FileSettings(BaseSettings):
    """Settings of a service: flags (init values) over environment variables over its table of the settings file
    named by CLEAVE_CONFIG over the defaults."""

    config_table: ClassVar[str] = ""  # the service's table in the file: ps, worker, scheduler, monitor
    model_config = SettingsConfigDict(allow_inf_nan=False)  # (a service's own model_config adds to this)

    def __init__(self, **values: Any) -> None:
        prefix = self.model_config.get("env_prefix", "")
        unknown = unknown_variables(type(self), os.environ)
        if unknown:
            names = sorted(n.upper() for n in type(self).model_fields)
            close = difflib.get_close_matches(unknown[0].upper().removeprefix(prefix.upper()), names, n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {', '.join(prefix + n for n in names)}"
            raise ConfigError(f"unknown variable{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} ({hint}): "
                              f"a {prefix}* variable names a setting of {type(self).__name__}")
        try:
            super().__init__(**values)
        except ValidationError as e:
            where = f"{type(self).__name__} (flags, {prefix}* variables"
            path = os.environ.get(CONFIG_ENV)
            where += f" or [{self.config_table}] of {path})" if path else ")"
            raise ConfigError(validation_message(e, where)) from None

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        path = os.environ.get(CONFIG_ENV)
        if not path or not cls.config_table:
            return init_settings, env_settings, dotenv_settings, file_secret_settings
        table = service_table(path, cls.config_table, cls.model_fields)
        return (init_settings, env_settings, dotenv_settings, InitSettingsSource(settings_cls, init_kwargs=table),
                file_secret_settings)
