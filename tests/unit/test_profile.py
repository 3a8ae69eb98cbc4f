"""Declared device profiles and the pacing that makes a worker honour one."""

import pytest

from cleave.errors import ConfigError
from cleave.plan.profile import Pacer, parse_profile


def test_parse_with_units():
    p = parse_profile("flops=5T,down=50M,up=8M,latency=0.02,memory=512Mi")
    assert p.flops == 5e12 and p.downlink_bytes_per_s == 50e6 and p.uplink_bytes_per_s == 8e6
    assert p.latency_s == 0.02 and p.memory_bytes == 512 * 2**20 and p.declared


@pytest.mark.parametrize("spec, words", [
    ("flops=5T,down=50M", "lacks"),
    ("flops=5T,down=50M,up=8M,latency=0.02,memory=512Mi,color=red", "expected one of"),
    ("flops=fast,down=50M,up=8M,latency=0.02,memory=1", "not a number"),
    ("flops=-1,down=50M,up=8M,latency=0.02,memory=1", "greater than or equal to 1000000"),
    ("flops=inf,down=50M,up=8M,latency=0.02,memory=1", "finite"),
    ("flops=5G,down=50M,up=8M,latency=1e9,memory=1", "latency= Input should be less than or equal to 10"),
    ("flops=5G,down=0,up=8M,latency=0.02,memory=1", "down= Input should be greater than or equal to 1000"),
    ("flops=5G,down=50M,up=8M,latency=0.02,memory=1,flops=6G", "flops= is given twice"),
])
def test_bad_profiles_say_what_is_wrong(spec, words):
    with pytest.raises(ConfigError, match=words) as e:
        parse_profile(spec)
    assert "\n" not in str(e.value)  # one line, by the profile's own key (not pydantic's dump of its model)


def test_pacer_follows_the_cost_model_and_streams_consecutive_tiles():
    pacer = Pacer(parse_profile("flops=1G,down=10M,up=5M,latency=0.1,memory=1Gi"))
    # downlink-bound: 20 MB at 10 MB/s = 2 s (+ 0.1 s latency)
    assert pacer.tile_time(20_000_000, 1000, 1e6) == pytest.approx(2.1)
    # compute-bound: 3 GFLOP at 1 GFLOP/s
    assert pacer.tile_time(1000, 1000, 3e9) == pytest.approx(3.1)
    # one tile alone: its stages in sequence (2 s down, 1 s compute, 1 s up) after 0.1 s latency
    assert pacer.finish_at(100.0, 20_000_000, 5_000_000, 1e9) == pytest.approx(104.1)
    # ten more arriving at once: downlink-bound, each adds its 2 s of download, not its 4 s in all
    ends = [pacer.finish_at(100.0, 20_000_000, 5_000_000, 1e9) for _ in range(10)]
    assert ends[-1] == pytest.approx(100.1 + 11 * 2 + 1 + 1)


def test_the_liveness_limit_adds_what_a_link_adds_to_a_heartbeat():
    from cleave.plan.profile import liveness_limit
    from cleave.schemas import DeviceProfile

    def p(up, latency=0.0):
        return DeviceProfile(flops=1e9, memory_bytes=1, downlink_bytes_per_s=1e7, uplink_bytes_per_s=up,
                             latency_s=latency)

    assert liveness_limit(1.0, p(5e6)) == pytest.approx(1.013, abs=1e-3)  # about the base: still ~1 s detection
    assert liveness_limit(1.0, p(0.4e6, 0.05)) == pytest.approx(1.0 + 0.1 + 65536 / 0.4e6)
    assert liveness_limit(1.0, p(5e6)) < liveness_limit(1.0, p(0.4e6)) < liveness_limit(1.0, p(50e3))
