"""Slow-consumer limits: every nats-server config we ship sets max_pending and write_deadline, and the PS
keeps less than both in flight to one worker (docs/operations.md, "Real links")."""

import re
from pathlib import Path

from cleave import auth
from cleave.bus import SERVER_LIMITS, SERVER_MAX_PENDING, SERVER_WRITE_DEADLINE_S
from cleave.gemm.dealer.model import DEFAULT_INFLIGHT_S
from cleave_cli import serverconf, topology
from cleave_cli.natsconf import NATS_CONFIG, NATS_LIMITS
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
