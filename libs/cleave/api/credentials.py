"""Reading back what `cleave auth init` wrote: every program that takes an auth directory (`--auth DIR`, or
the Python API's `auth=`) finds its own credential and the CA there."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from cleave import auth
from cleave.errors import ConfigError

TLS_DIR = "tls"  # <auth dir>/tls/: the CA, the server's certificate and key
CA_NAME = "ca.pem"


def read_env(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an env file `auth init` wrote (comments and blank lines skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.lstrip().startswith("#"))


def credential(folder: Path, name: str, role: str) -> auth.Credential:
    """The credential in `<folder>/<name>.env` (its seed; the public key derived again)."""
    path = folder / f"{name}.env"
    if not path.is_file():
        raise ConfigError(f"no {role} credential in {folder} ({path.name} is missing): run `cleave auth init` "
                          f"and give this machine its {path.name}")
    env = read_env(path)
    seed = next((v for k, v in env.items() if k.endswith("_NATS_NKEY_SEED")), "")
    if not seed:
        raise ConfigError(f"{path} holds no NATS seed")
    worker_id = name.removeprefix("worker-") if role == "worker" and name != "worker" else None
    probe = env.get(auth.PROBE_ECHO_ENV, "").strip() or None  # the scheduler's probe echo, in scheduler.env
    return auth.credential_from_seed(name, role, seed.strip(), worker_id, probe)


def ca_file(folder: Path) -> Path | None:
    """The CA clients verify the server with: `tls/ca.pem` of a hub's directory, or a site's `ca.pem`."""
    return next((p for p in (folder / TLS_DIR / CA_NAME, folder / CA_NAME) if p.is_file()), None)


def role_env(folder: Path, role: str, name: str | None = None) -> dict[str, str]:
    """The CLEAVE_<ROLE>_* variables a process of `role` logs in with (its seed and the CA)."""
    cred = credential(folder, name or role, role)
    env = {f"CLEAVE_{role.upper()}_NATS_NKEY_SEED": cred.seed, **{c.env_var: c.seed for c in cred.companions}}
    ca = ca_file(folder)
    if ca is not None:
        env[f"CLEAVE_{role.upper()}_NATS_TLS_CA"] = str(ca.resolve())
    return env


def client_options(folder: Path | None, role: str) -> dict[str, Any]:
    """`nats.connect` options of a command that logs in as `role` with the credential in `folder` (None: none)."""
    if folder is None:
        return auth.connect_options(SimpleNamespace(), role)
    cred, ca = credential(folder, role, role), ca_file(folder)
    return auth.connect_options(SimpleNamespace(nats_nkey_seed=cred.seed, nats_tls_ca=ca), role)
