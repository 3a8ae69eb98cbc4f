"""How a client waiting for a NATS server says so: once per distinct error, not once per retry (the Python API's
`status` of a hub not up printed ~30 warnings on stdout over 15 s before its one-line error)."""

from __future__ import annotations

import asyncio

import structlog

from cleave import bus as busmod
from cleave.api.natsconf import free_port
from tests.conftest import NatsServer


async def until(what, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout_s):
        while True:
            if what():
                return
            await asyncio.sleep(0.05)


async def test_a_server_not_up_is_told_once_not_at_each_retry(tmp_path) -> None:
    stop = asyncio.Event()
    port = free_port()
    with structlog.testing.capture_logs() as logs:
        asyncio.get_running_loop().call_later(3 * busmod.DEFAULT_RECONNECT_WAIT_S + 1.0, stop.set)
        assert await busmod.connect(f"nats://127.0.0.1:{port}", "waiting", stop=stop) is None
    said = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert said == ["nats_error"], said  # (and no `nats_disconnected` of a connection never made)


async def test_a_client_that_loses_its_server_says_so_and_once_again_after_it_is_back(tmp_path) -> None:
    server = NatsServer(tmp_path / "js", tmp_path / "nats.log")
    server.start()
    bus = await busmod.connect(server.url, "losing")
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                server.stop()
                await until(lambda: not bus.connected and any(e["event"] == "nats_error" for e in logs))
                await asyncio.sleep(4 * busmod.DEFAULT_RECONNECT_WAIT_S)  # retries meanwhile: not told
                server.start()
                await until(lambda: bus.connected)
                logs_now = [(e["event"], e.get("error")) for e in logs]
        events = [event for event, _ in logs_now]
        assert events.count("nats_disconnected") == 2 and events.count("nats_reconnected") == 2, logs_now
        errors: list[str] = []
        for event, error in logs_now:  # each error once while it was away (a refused connection: each retry)
            if event == "nats_reconnected":
                assert errors and len(errors) == len(set(errors)), logs_now
                errors = []
            elif event == "nats_error":
                errors.append(error)
    finally:
        await bus.close()
        server.stop()
