"""The worker's core on the device it computes on: cached blocks live there and count their bytes there, a
tile's product is exact and comes back to the host, FLOPS are measured there; the PS's host staging copies
each input once. Every test runs on the CPU and, where torch sees a GPU, on CUDA too (same code paths;
pinned memory only where CUDA exists)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cleave import codec
from cleave.schemas import BlockRef, TileTask
from cleave_ps.fleet.staging import HostStaging
from cleave_worker.core import BlockCache, compute, measure_flops, nbytes

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def ref(block_id: str, t: torch.Tensor | None) -> BlockRef:
    return BlockRef(id=block_id, tensor=None if t is None else codec.tensor_to_data(t))


def task() -> TileTask:
    return TileTask(job="j", epoch=1, step=0, op=1, gemm=1, tile=0, attempt=0, a=ref("a", None), b=ref("b", None),
                    reply="r", sent_at=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_cached_blocks_live_on_the_device_and_count_its_bytes(device):
    cache = BlockCache(3 * 64 * 32 * 4, device=torch.device(device))
    blocks = {f"b{i}": torch.randn(64, 32) for i in range(4)}
    for name, t in blocks.items():
        got = cache.resolve(ref(name, t))
        assert got.device.type == device and torch.equal(got.cpu(), t)
    assert cache.used == 3 * 64 * 32 * 4  # three fit; the least recently used went
    assert cache.get("b0") is None and all(cache.get(f"b{i}") is not None for i in (1, 2, 3))
    again = cache.resolve(ref("b1", None))  # by id only: a hit, from device memory
    assert again.device.type == device and torch.equal(again.cpu(), blocks["b1"]) and cache.hits == 1
    assert cache.resolve(ref("b0", None)) is None and cache.misses == 1
    bf16 = cache.resolve(ref("h", torch.randn(16, 32).to(torch.bfloat16)))
    assert bf16.dtype == torch.bfloat16 and bf16.device.type == device


def test_a_view_counts_its_whole_storage():
    big = torch.randn(100, 32)
    assert nbytes(big[:10]) == big.numel() * 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_is_computed_on_its_device_and_returned_exactly(device, dtype):
    cache = BlockCache(1 << 20, device=torch.device(device))
    a, bt = torch.randn(48, 40).to(dtype), torch.randn(24, 40).to(dtype)
    ra = ref("a", a)
    da, db = cache.resolve(ra), cache.resolve(ref("b", bt))
    res = compute(task(), da, db, "w")
    out = codec.data_to_tensor(res.out)
    if device == "cpu":  # the block is read from the message's bytes, the result sent from the product's memory
        assert da.data_ptr() == np.frombuffer(ra.tensor.data, dtype=np.uint8).__array_interface__["data"][0]
        assert isinstance(res.out.data, memoryview)
    want = (a.float().to(device) @ bt.float().to(device).T).cpu()  # the same product on the same device
    assert out.dtype == torch.float32 and out.shape == (48, 24) and torch.equal(out, want)
    assert res.compute_s > 0
    lying = codec.data_to_tensor(compute(task(), da, db, "w", corrupt=1.0).out)
    assert lying[0, 0] == want[0, 0] + 1.0 and torch.equal(lying[1:], want[1:])


@pytest.mark.parametrize("device", DEVICES)
def test_flops_are_measured_on_the_device(device):
    flops = measure_flops(n=128, reps=2, device=torch.device(device))
    assert 1e6 < flops < 1e16


def test_pinned_wire_data_only_where_cuda_exists():
    t = torch.randn(8, 8)
    if not torch.cuda.is_available():
        assert not codec.data_to_tensor(codec.tensor_to_data(t)).is_pinned()
        return
    pinned = codec.data_to_tensor(codec.tensor_to_data(t), pin=True)
    assert pinned.is_pinned() and torch.equal(pinned, t)


@pytest.mark.parametrize("device", DEVICES)
def test_staging_copies_each_input_once(device):
    staging = HostStaging()
    x, w1, w2 = (torch.randn(32, 16, device=device) for _ in range(3))
    hx, hw1 = staging.host(x, w1)
    assert hx.device.type == "cpu" and torch.equal(hx, x.cpu()) and torch.equal(hw1, w1.cpu())
    assert hx.is_pinned() == torch.cuda.is_available()
    view = x.view(32, 16)  # the same storage, shape and version (another view object, as q, k, v get)
    hx2, hw2 = staging.host(view, w2)
    assert hx2 is hx and torch.equal(hw2, w2.cpu()) and (staging.copies, staging.reused) == (3, 1)
    x.add_(1.0)  # changed in place: its version moved, so it is copied again
    hx3, _ = staging.host(x, w2)
    assert hx3 is not hx and torch.equal(hx3, x.cpu()) and staging.copies == 4


@pytest.mark.parametrize("busy", [False, True])
async def test_a_flops_re_measurement_beside_the_workers_own_tiles_is_discarded(monkeypatch, busy):
    """`DeviceState.reprobe` keeps the last FLOPS when a tile (or round) computed during the measurement: sharing
    the device, it would have measured less than the device has."""
    import asyncio

    from cleave.schemas import DeviceProfile
    from cleave_worker import device as wdevice
    from cleave_worker.settings import WorkerSettings

    profile = DeviceProfile(flops=8e10, memory_bytes=1 << 30, downlink_bytes_per_s=1e7, uplink_bytes_per_s=1e7,
                            latency_s=0.01)
    device = wdevice.DeviceState(WorkerSettings(worker_id="w1", probe_every_s=0.01), bus=None, profile=profile)
    stop = asyncio.Event()

    def measuring():
        if busy:
            with device.busy():  # a tile computes while the probe's product runs
                pass
        return 2e10

    async def measured(s, bus, flops):
        stop.set()  # one re-measurement is enough
        return profile.model_copy(update={"flops": flops})

    monkeypatch.setattr(wdevice, "measure_flops", measuring)
    monkeypatch.setattr(wdevice, "measured_profile", measured)
    await asyncio.wait_for(device.reprobe(stop), 10)
    assert device.profile.flops == (8e10 if busy else 2e10)



async def test_a_tile_quicker_than_a_millisecond_at_the_last_tiles_rate_is_multiplied_on_the_event_loop(monkeypatch):
    """`Tiles.on_tile` hands a CPU tile to a thread only when it takes more than `INLINE_S` at the rate this
    worker's last tile computed at (its profile's before the first): a thread and back costs about as much as a
    small tile's product. The rate comes from what the tiles measure, not from a declared profile."""
    from cleave.schemas import DeviceProfile
    from cleave_worker import device as wdevice
    from cleave_worker import tiles as wtiles
    from cleave_worker.settings import WorkerSettings

    hopped = []

    async def to_thread(fn, *args):
        hopped.append(args[1].shape[0])
        return fn(*args)

    monkeypatch.setattr(wtiles.asyncio, "to_thread", to_thread)
    profile = DeviceProfile(flops=1e12, memory_bytes=1 << 30, downlink_bytes_per_s=1e7, uplink_bytes_per_s=1e7,
                            latency_s=0.01, declared=True)  # a claim a thousand times what it is
    tiles = wtiles.Tiles(wdevice.DeviceState(WorkerSettings(worker_id="w1"), bus=None, profile=profile), bus=None)
    tiles.cache = BlockCache(1 << 24, device=torch.device("cpu"))  # CPU tiles (a GPU's go to a thread always)

    async def run(rows: int) -> None:
        a, bt = torch.randn(rows, 256), torch.randn(64, 256)
        t = task().model_copy(update={"a": ref("a", a), "b": ref("b", bt)})
        await tiles.on_tile(t, 0)
        _, result, _ = tiles.outbox.get_nowait()
        assert torch.equal(codec.data_view(result.out), a @ bt.T)

    await run(512)  # 16.8 MFLOP: under a millisecond at the claimed rate, on the loop
    assert hopped == [] and tiles.flops_per_s < 1e12  # now what the CPU computed at
    tiles.flops_per_s = 1e9  # (a slow device: 1 MFLOP a millisecond)
    await run(512)
    assert hopped == [512]
    tiles.flops_per_s = 1e9
    await run(4)  # 0.13 MFLOP: on the loop
    assert hopped == [512]
