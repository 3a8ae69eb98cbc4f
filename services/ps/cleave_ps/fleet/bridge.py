"""The training thread's GEMM backend on the PS: each GEMM of a linear layer handed to the dispatcher on the
event loop, the thread blocked until its product is assembled (or `gemm_timeout_s` passes)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import torch

from cleave.errors import StepAborted
from cleave.runtime.faults import Faults
from cleave_ps.fleet.dispatcher import Dispatcher
from cleave_ps.fleet.staging import HostStaging


class FleetGemm:
    """The GEMM backend of the PS's linear layers: blocks the training thread while the fleet computes; up to
    `deferred_gemms` weight gradients run beside the backward's other GEMMs (`cleave.gemm.tiled.LateGrads`)."""

    FAULT_OP = 10  # "in_step:N" kills the PS as it deals the 10th GEMM of step N

    def __init__(self, loop: asyncio.AbstractEventLoop, dispatcher: Dispatcher, faults: Faults | None = None) -> None:
        self.loop, self.dispatcher, self.faults = loop, dispatcher, faults or Faults()
        self.step, self.op = 0, 0
        self.staging = HostStaging()  # a CUDA PS's inputs, copied to the host once per GEMM
        self.stage: bool | None = None  # None: stage inputs that are on a GPU (a test stages CPU tensors too)
        self.deferred_gemms = dispatcher.s.deferred_gemms

    def begin(self, step: int) -> None:
        self.step, self.op = step, 0
        self.dispatcher.new_step()

    def gemm(self, a: torch.Tensor, bt: torch.Tensor, name: str) -> torch.Tensor:
        return self.submit(a, bt, name).result()

    def submit(self, a: torch.Tensor, bt: torch.Tensor, name: str, priority: int = 0) -> Submitted:
        """Deal a · btᵀ beside the GEMMs in flight (`priority`: `Dispatcher.gemm`); `.result()` waits."""
        self.op += 1
        if self.op == self.FAULT_OP:
            self.faults.hit("in_step", self.step)
        device, names = a.device, (a, bt)  # a CUDA PS ships host copies, its blocks named by the GPU tensors
        if self.stage if self.stage is not None else device.type == "cuda":
            a, bt = self.staging.host(a, bt)
        fut = asyncio.run_coroutine_threadsafe(
            self.dispatcher.gemm(a, bt, self.step, self.op, name, names, priority), self.loop
        )
        return Submitted(fut, device, f"GEMM {name} of step {self.step}", self.dispatcher.s.gemm_timeout_s)


class Submitted:
    """A GEMM on the fleet: its product once done, or StepAborted past `gemm_timeout_s` since it was submitted."""

    def __init__(self, fut: concurrent.futures.Future, device: torch.device, what: str, timeout_s: float) -> None:
        self.fut, self.device, self.what, self.timeout_s = fut, device, what, timeout_s
        self.due = time.monotonic() + timeout_s

    def result(self) -> torch.Tensor:
        try:  # assembled in pinned memory on CUDA: the copy back does not block
            return self.fut.result(timeout=max(0.0, self.due - time.monotonic())).to(self.device, non_blocking=True)
        except concurrent.futures.TimeoutError:
            self.fut.cancel()
            raise StepAborted(f"{self.what} took over gemm_timeout_s={self.timeout_s}") from None

    def cancel(self) -> None:
        self.fut.cancel()
