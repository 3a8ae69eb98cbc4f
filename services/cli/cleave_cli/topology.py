"""NATS past one server: a cluster of nats-servers (routes, JetStream replicated R3) and leaf nodes per site.

A cluster node's config is the single server's (`natsconf.NATS_CONFIG`, with every limit it sets) plus a
`server_name`, `sync_interval: always` (as compose's nats.conf), the `cluster` block with routes to every
other node, and a `leafnodes` listener that site leaf nodes dial. A site's leaf node runs no JetStream: its
workers use core NATS only (tiles, strips, results, heartbeats), and the hub delivers each message across
the leaf link once however many of the site's workers subscribe to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cleave.errors import ConfigError
from cleave_cli.natsconf import NATS_CONFIG, NATS_LIMITS, free_port

CLUSTER_NAME = "cleave"
CLUSTER_BLOCK = """\
server_name: {name}
cluster {{
  name: {cluster}
  listen: 127.0.0.1:{cluster_port}
  routes: [{routes}]
}}
"""
LEAF_LISTEN_BLOCK = """\
leafnodes {{
  listen: 127.0.0.1:{leaf_port}
}}
"""
LEAF_CONFIG = """\
server_name: leaf-{site}
listen: 127.0.0.1:{port}
http: 127.0.0.1:{monitor_port}
max_payload: {max_payload}
{limits}
leafnodes {{
  remotes: [{{ urls: [{hubs}] }}]
}}
"""


@dataclass
class Node:
    """One nats-server of the hub: its client, HTTP monitoring, cluster-route and leaf-node ports."""

    name: str
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)
    cluster_port: int = field(default_factory=free_port)
    leaf_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor(self) -> str:
        return f"http://127.0.0.1:{self.monitor_port}"


@dataclass
class Site:
    """A site's leaf node: its workers connect to `url`; it dials the hub's leaf-node ports."""

    name: str
    port: int = field(default_factory=free_port)
    monitor_port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def monitor(self) -> str:
        return f"http://127.0.0.1:{self.monitor_port}"


def with_sync_always(conf: str) -> str:
    """The config with JetStream fsyncing every write before acknowledging it (compose's nats.conf does)."""
    head, sep, tail = conf.partition("jetstream {\n")
    if not sep:
        raise ValueError("the nats config has no jetstream block")
    return f"{head}{sep}  sync_interval: always\n{tail}"


def node_config(node: Node, nodes: list[Node], store: str, max_payload: int) -> str:
    """The config of one hub node: routes to every other node (none for a cluster of one)."""
    conf = with_sync_always(NATS_CONFIG.format(port=node.port, monitor_port=node.monitor_port,
                                               max_payload=max_payload, limits=NATS_LIMITS, store=store))
    others = [n for n in nodes if n is not node]
    if others:
        routes = ", ".join(f"nats-route://127.0.0.1:{n.cluster_port}" for n in others)
        conf += CLUSTER_BLOCK.format(name=node.name, cluster=CLUSTER_NAME, cluster_port=node.cluster_port,
                                     routes=routes)
    else:
        conf += f"server_name: {node.name}\n"
    return conf + LEAF_LISTEN_BLOCK.format(leaf_port=node.leaf_port)


def leaf_config(site: Site, nodes: list[Node], max_payload: int) -> str:
    """A site's leaf node, dialling every hub node (it fails over between them)."""
    hubs = ", ".join(f'"nats-leaf://127.0.0.1:{n.leaf_port}"' for n in nodes)
    return LEAF_CONFIG.format(site=site.name, port=site.port, monitor_port=site.monitor_port,
                              max_payload=max_payload, limits=NATS_LIMITS, hubs=hubs)


def check_site_name(name: str) -> str:
    """A site name is used in file, process and server names: letters, digits, '-' and '_' only."""
    if not name or not all(c.isalnum() or c in "-_" for c in name) or len(name) > 64:
        raise ConfigError(f"--site {name!r}: use 1-64 letters, digits, '-' or '_'")
    return name


def get_json(url: str, timeout_s: float = 2.0) -> dict:
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 - our own 127.0.0.1 monitor
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # e.g. /healthz's 503 before JetStream has a leader: close its socket
        e.close()
        raise


def _poll(ok, what: str, timeout_s: float) -> None:
    import time

    from cleave.errors import CleaveError

    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            if ok():
                return
        except OSError as e:  # not listening yet, or /healthz answers 503 until JetStream has a leader
            last = e
        time.sleep(0.1)
    raise CleaveError(f"{what} not ready after {timeout_s}s (last: {last!r})")


def wait_healthy(monitors: list[str], timeout_s: float) -> None:
    """Until every node's /healthz is ok: JetStream enabled and, in a cluster, a meta leader elected."""
    for m in monitors:
        _poll(lambda m=m: get_json(f"{m}/healthz").get("status") == "ok", f"nats-server {m}", timeout_s)


def wait_leaf_connected(monitor: str, timeout_s: float) -> None:
    """Until the leaf node holds its connection to the hub (/leafz lists it)."""
    _poll(lambda: bool(get_json(f"{monitor}/leafz").get("leafs")), f"leaf node {monitor}", timeout_s)
