"""A hub's cluster routes as `cleave auth init --tls --cluster ...` writes them, on real nats-servers: only a node
holding a certificate of the cluster's CA joins (docs/security.md, "Cluster routes").

Every node, the cluster's own and the intruders alike, runs the `nats.conf` an `auth init` wrote, with nothing
changed but its ports and JetStream folder (one host: each node gets its own client, monitoring and cluster
port; the TLS and route blocks stay as written) and named with `nats-server --name`:

- two nodes from one `auth init --tls --cluster A,B` route to each other (/routez) and a message the PS's
  credential publishes on one reaches a worker's subscription on the other, both ways;
- a third node built the same way from a second `auth init --tls --cluster A,B` (another CA, the same route
  addresses) dials them and is refused: node 1 logs the failed TLS handshake, neither side lists the route, and
  no message crosses, whether the intruder trusts its own CA or the cluster's (which every client holds), or
  dials without TLS at all;
- a plain-text route login on node 1's cluster port is dropped unanswered: the server waits for TLS first.

The positive and the negative cases run the same code (`Cluster.node`, `routed`, `crosses`): only the `auth
init` output a node is built from differs, and each negative test first shows that node 2 joins.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest

from cleave.api import credentials
from cleave.api.natsconf import free_port, nats_server_binary
from cleave_cli import auth_cmd, serverconf

pytestmark = pytest.mark.timeout(60)

READY_TIMEOUT_S = 15.0
ROUTE_TIMEOUT_S = 10.0
OP_TIMEOUT_S = 5.0
SILENCE_S = 1.5  # how long a message that must not cross is waited for (it crosses in milliseconds when it may)
# what `auth init` is told, and each node's config then rewritten (exactly these strings, once each)
LISTEN, HTTP = "127.0.0.1:4222", "127.0.0.1:8222"
CLUSTER_LISTEN = f'listen: "{serverconf.DEFAULT_CLUSTER_LISTEN}"'
SUBJECT = "cleave.tile.w1"  # the PS publishes tiles, a worker (the shared credential) subscribes to them
UNKNOWN_CA = "failed to verify certificate: x509: certificate signed by unknown authority"
REFUSAL = {  # what node 1 logs when it refuses an intruder's route, by what the intruder trusts
    "cluster": UNKNOWN_CA,  # node 1's own check of the intruder's certificate
    "own": "remote error: tls:",  # the intruder could not verify node 1 and aborted the handshake (an alert)
    "plain": "first record does not look like a TLS handshake",  # no TLS at all
}


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=OP_TIMEOUT_S) as r:  # noqa: S310 - a local http:// URL
        return json.loads(r.read())


def auth_init(out: Path, cluster: str) -> Path:
    """`cleave auth init --tls --cluster <cluster>` into `out`, through the command's own code."""
    parser = argparse.ArgumentParser()
    auth_cmd.register(parser.add_subparsers(dest="command"))
    auth_cmd.init(parser.parse_args(["auth", "init", "--out", str(out), "--tls", "--cluster", cluster,
                                     "--listen", LISTEN, "--http", HTTP, "--store-dir", str(out / "js")]))
    return out


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, (old, text)
    return text.replace(old, new)


@dataclass
class Node:
    name: str
    out: Path  # the `auth init` output it runs (its clients' credentials and CA are there)
    port: int
    http: int
    cluster_port: int
    log: Path
    config: str
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    def routes(self) -> set[str]:
        """The names of the servers this one holds a route with (its /routez)."""
        return {r.get("remote_name", "") for r in get_json(f"http://127.0.0.1:{self.http}/routez")["routes"] or []}

    def logged(self) -> str:
        return self.log.read_text(errors="replace")

    async def client(self, role: str) -> nats.NATS:
        """A connection with the credential `auth init` issued to `role`, verifying this node against its CA."""
        return await nats.connect(self.url, allow_reconnect=False, connect_timeout=OP_TIMEOUT_S,
                                  **credentials.client_options(self.out, role))


@dataclass
class Cluster:
    """Cluster ports chosen first, so that every `auth init` names the same two route addresses."""

    tmp: Path
    ports: tuple[int, int] = field(default_factory=lambda: (free_port(), free_port()))
    nodes: list[Node] = field(default_factory=list)

    @property
    def routes_arg(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def init(self, name: str) -> Path:
        return auth_init(self.tmp / name, self.routes_arg)

    def node(self, name: str, out: Path, cluster_port: int | None = None, route_ca: Path | None = None,
             plain_routes: bool = False) -> Node:
        """A node running `out`'s nats.conf with its own ports and store; `route_ca`: the CA its routes trust
        instead of `out`'s; `plain_routes`: its cluster block without TLS."""
        port, http = free_port(), free_port()
        cluster_port = cluster_port or free_port()
        text = (out / auth_cmd.CONFIG_NAME).read_text()
        for a, b in ((f'listen: "{LISTEN}"', f'listen: "127.0.0.1:{port}"'),
                     (f'http: "{HTTP}"', f'http: "127.0.0.1:{http}"'),
                     (f'store_dir: "{out / "js"}"', f'store_dir: "{self.tmp / "js" / name}"'),
                     (CLUSTER_LISTEN, f'listen: "127.0.0.1:{cluster_port}"')):
            text = replace_once(text, a, b)
        cluster = text[text.index("\ncluster {"):]
        assert f"routes: [{', '.join(json.dumps(f'nats-route://127.0.0.1:{p}') for p in self.ports)}]" in cluster
        assert "verify: true" in cluster and str(out.resolve() / "tls" / "ca.pem") in cluster
        if route_ca is not None:
            text = replace_once(text, f'ca_file: "{(out / "tls" / "ca.pem").resolve()}"', f'ca_file: "{route_ca}"')
        if plain_routes:
            tls = cluster[cluster.index("  tls {"):cluster.index("  }\n", cluster.index("  tls {")) + 4]
            text = replace_once(text, tls, "")
        node = Node(name, out, port, http, cluster_port, self.tmp / f"{name}.log", text)
        (self.tmp / f"{name}.conf").write_text(text)
        with open(node.log, "ab") as f:
            node.proc = subprocess.Popen([nats_server_binary(), "-c", str(self.tmp / f"{name}.conf"), "--name", name],
                                         stdout=f, stderr=subprocess.STDOUT)
        self.nodes.append(node)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "Server is ready" not in node.logged():
            assert node.proc.poll() is None and time.monotonic() < deadline, node.logged()[-3000:]
            time.sleep(0.02)
        return node

    def start_pair(self) -> tuple[Node, Node]:
        """The cluster's two nodes, from one `auth init`, routed to each other."""
        out = self.init("auth")
        n1 = self.node("n1", out, self.ports[0])
        n2 = self.node("n2", out, self.ports[1])
        routed(n1, {"n2"})
        routed(n2, {"n1"})
        return n1, n2

    def stop(self) -> None:
        for n in reversed(self.nodes):
            if n.proc is not None and n.proc.poll() is None:
                n.proc.terminate()
                n.proc.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def routed(node: Node, names: set[str]) -> None:
    """Until `node`'s /routez lists exactly the routes to `names`."""
    deadline = time.monotonic() + ROUTE_TIMEOUT_S
    while (got := node.routes()) != names:
        assert time.monotonic() < deadline, (node.name, got, node.logged()[-3000:])
        time.sleep(0.05)


def wait_logged(node: Node, text: str, offset: int) -> str:
    """Until what `node` logged after `offset` contains `text`; returns that line."""
    deadline = time.monotonic() + ROUTE_TIMEOUT_S
    while text not in (new := node.logged()[offset:]):
        assert time.monotonic() < deadline, (text, new[-3000:])
        time.sleep(0.05)
    return next(line for line in new.splitlines() if text in line)


async def crosses(pub: Node, sub: Node, window_s: float) -> bool:
    """Whether a message the PS publishes on `pub` reaches a worker's subscription on `sub` within `window_s`
    (it is published again until then: the subscription's interest takes a moment to cross a route)."""
    worker, ps = await sub.client("worker"), await pub.client("ps")
    try:
        inbox = await worker.subscribe(SUBJECT)
        await worker.flush(timeout=OP_TIMEOUT_S)
        deadline = time.monotonic() + window_s
        while time.monotonic() < deadline:
            await ps.publish(SUBJECT, f"from {pub.name}".encode())
            await ps.flush(timeout=OP_TIMEOUT_S)
            try:
                msg = await inbox.next_msg(timeout=0.1)
            except nats.errors.TimeoutError:
                continue
            assert msg.data == f"from {pub.name}".encode()
            return True
        return False
    finally:
        await worker.close()
        await ps.close()


async def test_two_nodes_of_one_auth_init_route_and_carry_messages(cluster: Cluster) -> None:
    """The written routes come up (each node's /routez names the other) and carry the credentials' traffic."""
    n1, n2 = cluster.start_pair()
    assert await crosses(n1, n2, ROUTE_TIMEOUT_S)  # the PS on node 1, a worker on node 2
    assert await crosses(n2, n1, ROUTE_TIMEOUT_S)  # and back
    assert "TLS route handshake error" not in n1.logged() + n2.logged()


@pytest.mark.parametrize("trusts", ["own", "cluster", "plain"])
async def test_a_node_of_another_ca_is_refused(cluster: Cluster, trusts: str) -> None:
    """An intruder runs its own `auth init --tls --cluster` naming the cluster's nodes, trusting its own CA, or
    the cluster's (public: every client holds it) so that only node 1's check of the intruder's certificate stands
    between them, or with its routes in plain text. Node 1 refuses its route, and nothing crosses."""
    n1, n2 = cluster.start_pair()  # the same machinery lets node 2 in (and carry a message) ...
    assert await crosses(n2, n1, ROUTE_TIMEOUT_S)
    offset = len(n1.logged())
    other = cluster.init("intruder-auth")
    assert (other / "tls" / "ca.pem").read_bytes() != (cluster.tmp / "auth" / "tls" / "ca.pem").read_bytes()
    intruder = cluster.node("intruder", other, route_ca=(cluster.tmp / "auth" / "tls" / "ca.pem").resolve()
                            if trusts == "cluster" else None, plain_routes=trusts == "plain")
    # ... but not the intruder: node 1 sees it try, and fail, to route
    error = wait_logged(n1, "TLS route handshake error", offset)
    assert REFUSAL[trusts] in error, error
    if trusts == "own":  # it could not verify node 1's certificate, and said so to node 1
        assert UNKNOWN_CA in wait_logged(intruder, "TLS route handshake error", 0)
    assert n1.routes() == {"n2"} and n2.routes() == {"n1"} and intruder.routes() == set()
    assert not await crosses(intruder, n1, SILENCE_S)
    assert not await crosses(n1, intruder, SILENCE_S)
    # and it keeps failing: its next attempt is refused the same way
    assert REFUSAL[trusts] in wait_logged(n1, "TLS route handshake error", len(n1.logged()))
    assert n1.routes() == {"n2"} and intruder.routes() == set()


def test_a_plain_text_route_login_is_dropped(cluster: Cluster) -> None:
    """A route login sent in plain text to node 1's cluster port (which waits for a TLS handshake first, before
    it says anything): the connection is closed without an answer and no route appears."""
    n1, _ = cluster.start_pair()
    offset = len(n1.logged())
    with socket.create_connection(("127.0.0.1", n1.cluster_port), timeout=OP_TIMEOUT_S) as s, s.makefile("rb") as f:
        s.sendall(b'CONNECT {"verbose":false,"pedantic":false,"tls_required":false,"name":"plain",'
                  b'"cluster":"cleave"}\r\nPING\r\n')
        assert f.read() == b""  # closed: no INFO, no PONG
    assert REFUSAL["plain"] in wait_logged(n1, "TLS route handshake error", offset)
    assert n1.routes() == {"n2"}
