"""Golden bytes of every wire message: one fixed instance of each message type, encoded by the codec, must
give exactly the bytes recorded in `golden/wire.json`. A change of a field name, order, default or encoding
(or a message moved to another module in a way that changes what is sent) fails here, before a peer of
another version notices. A new message type must add its instance here (the enumeration check fails
otherwise). To record the bytes after an intended wire change: `.venv/bin/python tests/unit/test_wire_golden.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cleave import codec, schemas
from cleave.schemas import Wire

GOLDEN = Path(__file__).parent / "golden" / "wire.json"


def _tensor() -> schemas.TensorData:
    return codec.tensor_to_data(torch.arange(6, dtype=torch.float32).reshape(2, 3) / 4)


def _profile(i: int = 0) -> schemas.DeviceProfile:
    return schemas.DeviceProfile(flops=1e9 * (i + 1), memory_bytes=512 << 20, downlink_bytes_per_s=1e7,
                                 uplink_bytes_per_s=5e6, latency_s=0.02, declared=bool(i % 2))


def _plan() -> schemas.Plan:
    workers = [schemas.PlanWorker(worker_id=f"w{i}", profile=_profile(i), cache_bytes=1 << 20) for i in range(3)]
    layout = schemas.GemmLayout(m=4, n=6, k=8, boxes=np.array([0, 4, 0, 2, 0, 4, 2, 4, 0, 4, 4, 6]),
                                owners=["w0", "w1", "w2"], makespan_s=0.5)
    return schemas.Plan(version=7, created_at=1700000000.5, workers=workers, tile_rows=1024, tile_cols=512, chunks=4,
                        gemms=(layout,), predicted_step_s=1.25, lower_bound_s=1.0, planner="cost", reason="join")


def _block(i: int) -> schemas.BlockRef:
    part = schemas.BlockPart(id=f"1.{i}.0.2", tensor=_tensor(), fanout=False)
    return schemas.BlockRef(id=f"1.{i}.0.4", tensor=None, fanout=False, parts=(part, schemas.BlockPart(id=f"1.{i}.2.4")))


def _packed() -> schemas.Packed:
    return schemas.Packed(kind="int8", dtype="float32", shape=(2, 3),
                          values=codec.tensor_to_data(torch.arange(6, dtype=torch.int8)),
                          scales=codec.tensor_to_data(torch.tensor([0.5], dtype=torch.float32)), block=64)


def _event() -> schemas.Event:
    return schemas.Event(kind="recovered", at=1700000001.0, job="j", step=3, worker_id="w1", cause="deadline",
                         detect_s=0.5, redispatch_s=0.01, complete_s=0.7, detail={"gemm": "h0.attn.fwd"})


def _secagg_keys() -> schemas.SecAggKeys:
    return schemas.SecAggKeys(c_pk=bytes(range(32)), s_pk=bytes(range(32, 64)))


def _secagg_reply() -> schemas.SecAggReply:
    return schemas.SecAggReply(session="0123abcd", phase="reveal", b_shares={"w1": b"\x01" * 66},
                               s_shares={"w3": b"\x02" * 66})


def _metrics() -> schemas.StepMetrics:
    return schemas.StepMetrics(job="j", step=3, loss=2.5, step_time_s=0.75, workers=4, tiles=96, tiles_resent=2,
                               bytes_down=1 << 20, bytes_up=1 << 18, tokens=2048, lr=3e-4, val_loss=2.75, recoveries=1,
                               recovery=(_event(),), gemm_s=0.5, predicted_gemm_s=0.4, dp_epsilon=1.5, at=1700000002.0)


INSTANCES: dict[str, Wire] = {
    "TensorData": _tensor(),
    "Packed": _packed(),
    "PackedTensors": schemas.PackedTensors(tensors={"h.0.w": _packed()}),
    "DeviceProfile": _profile(1),
    "Probe": schemas.Probe(payload=b"x" * 16, reply_bytes=64),
    "Observed": schemas.Observed(job="j", at=1700000000.0, workers=(
        schemas.WorkerObserved(worker_id="w1", tiles=12, observed_s=3.5, predicted_s=0.25, flops=1e12),)),
    "WorkerObserved": schemas.WorkerObserved(worker_id="w2", tiles=8, observed_s=1.0, predicted_s=1.0, flops=5e9),
    "Heartbeat": schemas.Heartbeat(worker_id="w1", profile=_profile(), sent_at=1700000000.0, started_at=1699999999.0,
                                   cache_bytes=1 << 27, tiles_done=5, busy_s=1.5),
    "DeviceRecord": schemas.DeviceRecord(worker_id="w1", profile=_profile(), first_seen=1.0, last_seen=2.0,
                                         cache_bytes=1 << 27, tiles_done=5),
    "PlanWorker": schemas.PlanWorker(worker_id="w1", profile=_profile(), cache_bytes=1 << 20),
    "GemmSpec": schemas.GemmSpec(name="h0.attn.fwd", m=2048, n=768, k=768, count_per_step=12),
    "JobShapes": schemas.JobShapes(job="j", gemms=(schemas.GemmSpec(name="g", m=4, n=6, k=8),), dtype_bytes=2,
                                   memory_dtype_bytes=4, replicas=2),
    "GemmLayout": _plan().gemms[0],
    "Plan": _plan(),
    "BlockPart": schemas.BlockPart(id="1.2.0.4", tensor=_tensor(), fanout=True),
    "BlockRef": _block(2),
    "BlockPush": schemas.BlockPush(job="j", epoch=1, gemm=9, block=schemas.BlockRef(id="1.2.0.4", tensor=_tensor())),
    "FanoutJoin": schemas.FanoutJoin(job="j", epoch=1, version=7, subjects=("cleave.fan.j.1.ab12",)),
    "LinkCheck": schemas.LinkCheck(job="j", epoch=1, sent_at=1700000000.25, payload=bytes(32)),
    "LinkCheckAck": schemas.LinkCheckAck(worker_id="w1"),
    "FanoutAck": schemas.FanoutAck(worker_id="w1", joined=("cleave.fan.j.1.ab12",), error=""),
    "TileTask": schemas.TileTask(job="j", epoch=1, step=3, op=4, gemm=9, tile=5, attempt=1, a=_block(1), b=_block(2),
                                 reply="cleave.result.j.1.w1", sent_at=1700000000.5, rounded="bfloat16"),
    "TileResult": schemas.TileResult(job="j", epoch=1, step=3, op=4, gemm=9, tile=5, attempt=1, worker_id="w1",
                                     out=_tensor(), missing=("1.2.0.4",), error="", compute_s=0.125),
    "Event": _event(),
    "RoundTask": schemas.RoundTask(job="j", epoch=1, method="fedavg", round=2, job_config='{"method": "fedavg"}',
                                   weights=schemas.PackedTensors(tensors={"h.0.w": _packed()}), shard=1,
                                   reply="cleave.update.j.1.{worker_id}", shards={"w1": 0, "w2": 1},
                                   base_bundle="ab" * 32, tokenizer_bundle="cd" * 32, session="0123abcd"),
    "RoundUpdate": schemas.RoundUpdate(job="j", epoch=1, round=2, worker_id="w1",
                                       delta=schemas.PackedTensors(tensors={"h.0.w": _packed()}), weight=2048.0,
                                       losses=(2.5, 2.25), raw_bytes=24, error="", data_tokens=4096, refused=False,
                                       secagg=_secagg_reply()),
    "SplitTask": schemas.SplitTask(job="j", epoch=1, step=3, phase="backward", job_config="{}", split_layers=1,
                                   reply="cleave.update.j.1.w1", grad=_tensor(), grad_sq_norm=4.0, loss=2.5,
                                   tokenizer_bundle="cd" * 32),
    "SplitReply": schemas.SplitReply(job="j", epoch=1, step=3, phase="forward", worker_id="w1", activations=_tensor(),
                                     targets=codec.tensor_to_data(torch.arange(4)), clip_coef=0.5),
    "StepMetrics": _metrics(),
    "SecAggKeys": _secagg_keys(),
    "SecAggReply": _secagg_reply(),
    "SecAggTask": schemas.SecAggTask(job="j", epoch=1, round=2, session="0123abcd", phase="mask", threshold=2,
                                     keys={"w1": _secagg_keys()}, ciphertexts={"w2": b"\x03" * 160},
                                     members=("w1", "w2", "w3"), dropped=("w4",)),
    "BundleFile": schemas.BundleFile(name="model.safetensors", size=24, sha256="ab" * 32, chunk_bytes=16 << 20,
                                     chunk_sha256=("ab" * 32,)),
    "Bundle": schemas.Bundle(kind="model", files=(schemas.BundleFile(name="config.json", size=2, sha256="cd" * 32,
                                                                      chunk_bytes=16 << 20, chunk_sha256=("cd" * 32,)),)),
    "ModelsGet": schemas.ModelsGet(kind="file", sha256="ab" * 32, offset=1 << 20, length=1 << 20),
    "ModelsPart": schemas.ModelsPart(sha256="ab" * 32, offset=1 << 20, size=3 << 20, data=b"\x05" * 16,
                                     error=""),
    "TensorEntry": schemas.TensorEntry(key="model.h.0.w", dtype="float32", shape=(2, 3)),
    "CheckpointManifest": schemas.CheckpointManifest(
        job="j", step=3, epoch=1, created_at=1700000003.0, data_object="j.3.data", size=24, chunk_bytes=16 << 20,
        chunk_sha256=("ab" * 32,), tensors=(schemas.TensorEntry(key="model.h.0.w", dtype="float32", shape=(2, 3)),),
        optimizer_groups=[{"lr": 3e-4, "betas": [0.9, 0.95]}], rng=codec.tensor_to_data(torch.arange(4, dtype=torch.uint8))),
    "StateHead": schemas.StateHead(job="j", step=3, epoch=1, object="j.3.manifest", sha256="cd" * 32, size=24,
                                   job_config="{}", metrics=(_metrics(),)),
    "JobSubmission": schemas.JobSubmission(job='{"job_id": "j", "preset": "tiny"}', nonce="0123456789abcdef",
                                           submitted_at=1700000004.0, min_workers=4),
    "JobRecord": schemas.JobRecord(job_id="j", job='{"job_id": "j"}', state="failed", submitted_at=1700000004.0,
                                   min_workers=4, started_at=1700000005.0, ended_at=1700000006.0, exit_code=4,
                                   reason="changed", runs=2, nonce="0123456789abcdef", verdict="refused",
                                   verdict_reason="running"),
}


def _wire_types() -> set[str]:
    seen, todo = set(), [Wire]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("cleave") and sub.__name__ not in seen:
                seen.add(sub.__name__)
                todo.append(sub)
    return seen


def _encoded() -> dict[str, str]:
    return {name: codec.encode(msg, compress=False).hex() for name, msg in sorted(INSTANCES.items())}


def test_every_message_type_has_a_golden_instance() -> None:
    assert _wire_types() == set(INSTANCES), "add an instance of each new message type to INSTANCES"


@pytest.mark.parametrize("name", sorted(INSTANCES))
def test_message_bytes_are_the_recorded_ones(name: str) -> None:
    golden = json.loads(GOLDEN.read_text())
    assert _encoded()[name] == golden[name], f"{name}'s wire bytes changed"
    msg = codec.decode(bytes.fromhex(golden[name]), type(INSTANCES[name]))
    assert codec.encode(msg, compress=False).hex() == golden[name], f"{name} does not survive a round trip"


if __name__ == "__main__":  # record the golden bytes after an intended wire change
    GOLDEN.write_text(json.dumps(_encoded(), indent=1) + "\n")
