"""The shaped-link lab's pure parts: fleet files, tbf arguments, names (no namespace is created here)."""

import json

import pytest

from cleave.errors import ConfigError
from cleave.runtime.netlab import Link, Netlab, load_links, tbf


def test_links_come_from_a_fleet_file_and_missing_rates_mean_unshaped(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps([{"id": "phone", "downlink_bytes_per_s": 10e6, "uplink_bytes_per_s": 5e6, "flops": 1e12},
                                {"id": "lan"}, {"id": "slow-cpu", "cpu_cores": 0.25}]))
    assert load_links(path) == [Link("phone", 10e6, 5e6), Link("lan"), Link("slow-cpu", cpu=0.25)]


@pytest.mark.parametrize("entry", [{"downlink_bytes_per_s": 1e6}, {"id": "x", "uplink_bytes_per_s": -1},
                                   {"id": "x", "downlink_bytes_per_s": "fast"}, {"id": "x", "cpu_cores": 0.05}])
def test_a_bad_fleet_file_is_refused_with_its_reason(tmp_path, entry):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps([entry]))
    with pytest.raises(ConfigError, match="fleet file"):
        load_links(path)


def test_tbf_shapes_bytes_per_second_with_a_short_queue():
    args = tbf("cl000000e1", 5e6)
    assert args[args.index("rate") + 1] == "40000000bit"  # tc's rate is in bits
    burst, limit = int(args[args.index("burst") + 1]), int(args[args.index("limit") + 1])
    assert burst >= 5e6 / 100 and limit == int(5e6 * 0.05)  # >= rate / HZ; 50 ms of queue
    small = tbf("cl000000e2", 20e3)
    assert int(small[small.index("burst") + 1]) == 16 * 1024  # at least a few MTUs, or it cannot reach its rate


def test_names_are_unique_per_lab_and_fit_the_kernel_limit():
    a, b = Netlab([Link("x"), Link("y")]), Netlab([Link("x")])
    assert a.prefix != b.prefix and a.hub.startswith(a.prefix) and a.ns("y") == f"{a.prefix}-w2"
    assert all(len(d) <= 15 for d in a._devs("y"))  # IFNAMSIZ
    assert a.nats_url("y") == "nats://10.77.2.1:4222" and a.nats_url() == "nats://127.0.0.1:4222"
    with pytest.raises(ConfigError):
        Netlab([Link("x"), Link("x")])


def test_a_cpu_share_below_the_kernels_smallest_quota_is_refused():
    with pytest.raises(ConfigError, match="cpu"):
        Netlab([Link("x", cpu=0.01)])
    lab = Netlab([Link("x", cpu=0.5)])
    assert lab.wrap(lab.ns("x"), ["true"]) == ["ip", "netns", "exec", lab.ns("x"), "true"]  # none until created
