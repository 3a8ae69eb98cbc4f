"""Slow-consumer limits: every nats-server config we ship sets max_pending and write_deadline, and the PS
keeps less than both in flight to one worker (docs/operations.md, "Real links"); and the ports it listens on."""

import re
import socket
from pathlib import Path

from cleave import auth
from cleave.api import topology
from cleave.api.natsconf import NATS_CONFIG, NATS_LIMITS, ephemeral_range, free_port
from cleave.bus.limits import SERVER_LIMITS, SERVER_MAX_PENDING, SERVER_WRITE_DEADLINE_S
from cleave.gemm.dealer.model import DEFAULT_INFLIGHT_S
from cleave_cli import serverconf
from cleave_ps.settings import PsSettings

COMPOSE = Path(__file__).parents[2] / "compose" / "nats"


def limits(conf: str) -> tuple[int, int]:
    pending = int(re.search(r"^max_pending:\s*(\d+)", conf, re.M).group(1))
    deadline = int(re.search(r'^write_deadline:\s*"(\d+)s"', conf, re.M).group(1))
    return pending, deadline


def test_every_shipped_config_sets_the_limits():
    local = NATS_CONFIG.format(port=4222, monitor_port=8222, max_payload=1 << 20, limits=NATS_LIMITS, store="/x")
    generated = serverconf.server_config([], serverconf.ServerOptions())
    site = serverconf.leaf_config(auth.site_credential("lab"), auth.new_credential("worker"),
                                  serverconf.LeafOptions("lab", "127.0.0.1:4222", "127.0.0.1:8222", ("tls://hub:7422",)))
    nodes = [topology.Node(f"nats-{i}") for i in (1, 2, 3)]
    cluster = [topology.node_config(n, nodes, "/x", 1 << 20) for n in nodes]
    leaf = topology.leaf_config(topology.Site("lab"), nodes, 1 << 20)
    compose = [(COMPOSE / f).read_text() for f in ("nats.conf", "cluster.conf")]
    for conf in (local, generated, *cluster, leaf, site, *compose):
        assert limits(conf) == (SERVER_MAX_PENDING, SERVER_WRITE_DEADLINE_S)
    assert SERVER_LIMITS in local and SERVER_LIMITS in generated


def test_the_ps_keeps_less_than_the_limits_in_flight_to_a_worker():
    assert 0 < PsSettings().max_inflight_bytes < SERVER_MAX_PENDING
    assert DEFAULT_INFLIGHT_S * 10 <= SERVER_WRITE_DEADLINE_S  # 2 s of its downlink, a tenth of the deadline


def test_free_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    """Outgoing connections take ephemeral ports: a listening port drawn there could be taken between its draw
    and the server's bind (a cluster node's routes dialling the next node's)."""
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)
    with socket.socket() as s:  # one of them really is free
        s.bind(("127.0.0.1", ports[0]))
