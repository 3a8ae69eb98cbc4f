"""A command that cannot log in at a hub says why, at once: the wrong CA, no --auth, another deployment's
credential, the leaf-node port, a plain server at a tls:// URL, an unknown host. Each of these waited 15 s and
said "could not reach NATS" (nats-py retries any server it cannot use); only a server that is not up is still
retried, and its message names what the first try met. A real nats-server with `cleave auth init`'s config."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cleave.api import hub
from cleave.api.natsconf import free_port
from cleave.errors import CleaveError
from cleave_cli import auth_cmd
from tests.integration import authserver
from tests.integration.authserver import AuthServer, launch

server = authserver.server  # a fixture
FAST_S = 8.0  # a refusal no retry mends is said well inside the 15 s connect timeout


@pytest.fixture
def tls_site_hub(tmp_path: Path) -> Iterator[AuthServer]:
    """`cleave auth init --tls --sites s1`: TLS for clients and for the sites' leaf-node port."""
    yield from launch(tmp_path, tls=True, hosts=["127.0.0.1", "localhost"], sites="s1",
                      leaf_listen=f"127.0.0.1:{free_port()}")


def _refused(url: str, folder: Path | None) -> str:
    started = time.monotonic()
    with pytest.raises(CleaveError) as e:
        hub.status(url, folder)
    took = time.monotonic() - started
    return f"{took:.1f}s {e.value}"


def test_each_refusal_is_named_at_once(tls_site_hub: AuthServer, tmp_path: Path) -> None:
    hub_ = tls_site_hub
    assert hub.status(hub_.url, hub_.out) == []  # the hub's own folder logs in (no jobs yet)
    other = tmp_path / "other"  # another deployment: its own CA and credentials
    auth_cmd.init(authserver.init_args(other, free_port(), tls=True))
    mixed = tmp_path / "mixed"  # this hub's CA, another deployment's submitter
    (mixed / "tls").mkdir(parents=True)
    shutil.copy(hub_.out / "tls" / "ca.pem", mixed / "tls" / "ca.pem")
    shutil.copy(other / "submitter.env", mixed / "submitter.env")
    cases = {
        (hub_.url, other): f"{other}/tls/ca.pem did not sign it",
        (hub_.url, None): "this machine's trust store does not trust it (unable to get local issuer certificate): "
                          "pass --auth DIR",
        (hub_.url, mixed): f"it refused the credential {mixed}/submitter.env (Authorization Violation)",
        (f"tls://127.0.0.1:{hub_.leaf_port}", hub_.out): "that is the hub's leaf-node port, for `cleave site`",
        ("tls://no-such-host.invalid:4222", hub_.out): "its host name is not known here",
    }
    for (url, folder), said in cases.items():
        told = _refused(url, folder)
        assert said in told and float(told.split("s ", 1)[0]) < FAST_S, (url, folder, told)


def test_a_plain_server_at_a_tls_url_and_a_closed_port_are_told_apart(server: AuthServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub, "DEFAULT_CONNECT_TIMEOUT_S", 6.0)  # (the retries of a hub not up: 15 s by default)
    tls_url = server.url.replace("nats://", "tls://")
    told = _refused(tls_url, server.out)
    assert "it does not serve TLS, which its tls:// URL asks for" in told and float(told.split("s ", 1)[0]) < FAST_S
    told = _refused(f"nats://127.0.0.1:{free_port()}", server.out)  # not up: retried, then its cause named
    assert "within 6s: nothing listens there (connection refused)" in told, told


def test_a_worker_started_by_hand_with_another_deployments_folder_says_so(tls_site_hub: AuthServer,
                                                                         tmp_path: Path) -> None:
    """`cleave worker --nats URL --auth DIR` with a folder whose CA is not the hub's logged `nats_error` every
    half second, for ever; a hub that is not up is still waited for (a service's promise)."""
    other = tmp_path / "other"
    auth_cmd.init(authserver.init_args(other, free_port(), tls=True))
    done = subprocess.run([sys.executable, "-m", "cleave_cli", "worker", "--nats", tls_site_hub.url, "--auth",
                           str(other)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{other}/tls/ca.pem did not sign it" in done.stderr, done.stderr[-2000:]
    waiting = subprocess.Popen([sys.executable, "-m", "cleave_cli", "worker", "--nats",
                                f"tls://127.0.0.1:{free_port()}", "--auth", str(tls_site_hub.out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=6)  # nothing listens there yet: it keeps trying
    finally:
        waiting.terminate()
        waiting.wait(timeout=30)


def test_cleave_train_at_a_hub_not_up_says_so_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`cleave train --nats URL` (it reads the workers' budgets there) printed the client's `nats_error` warning
    about twice a second on stdout, ~31 lines, before its one-line error."""
    from cleave_cli.main import main  # noqa: PLC0415

    monkeypatch.setattr(hub, "DEFAULT_CONNECT_TIMEOUT_S", 3.0)
    url = f"nats://127.0.0.1:{free_port()}"
    assert main(["train", "--preset", "tiny", "--steps", "1", "--nats", url, "--run-dir", str(tmp_path / "r")]) == 2
    said = capsys.readouterr()
    assert said.out == "" and said.err.strip().splitlines() == [
        f"cleave: error: could not reach NATS at {url} within 3s: nothing listens there (connection refused): is "
        "the hub up, and is this its client port?"], said


PROGRAM = """
import sys, structlog
from cleave.api import hub
hub.DEFAULT_CONNECT_TIMEOUT_S = 2.0
def mine(_logger, _method, event):
    print("mine:", event["event"], file=sys.stderr)
    raise structlog.DropEvent
if sys.argv[1] == "own":  # a program with its own logging keeps it
    structlog.configure(processors=[mine])
try:
    hub.status(sys.argv[2])
except Exception as e:
    print("told:", e)
if sys.argv[1] == "default":  # a program's own lines on structlog's defaults are left as they were
    structlog.get_logger("mine").info("still_mine")
"""


@pytest.mark.parametrize("logging_", ["none", "own", "default"])
def test_a_program_calling_the_api_gets_no_log_lines_in_its_output(logging_: str) -> None:
    """A program or notebook that asked for the status of a hub not up had the client's `nats_error` warnings
    printed among its own output (structlog, not configured, prints every line on stdout)."""
    url = f"nats://127.0.0.1:{free_port()}"
    run = subprocess.run([sys.executable, "-c", PROGRAM, logging_, url], capture_output=True, text=True, timeout=60,
                         check=True)
    told, *own = run.stdout.splitlines()
    assert told == (f"told: could not reach NATS at {url} within 2s: nothing listens there (connection refused): "
                    "is the hub up, and is this its client port?"), run
    assert own == [] if logging_ != "default" else len(own) == 1 and "still_mine" in own[0], run
    mine = [line for line in run.stderr.splitlines() if line.startswith("mine:")]
    assert run.stderr.strip() == "" if logging_ != "own" else mine and set(mine) == {"mine: nats_error"}, run
