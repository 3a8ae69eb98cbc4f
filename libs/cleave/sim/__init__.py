"""Simulation at internet scale: training steps of a model over thousands of simulated edge devices, driven
by the planner and the PS's tile ledger, next to cost models of the edge-training baselines.

- `world`: the devices, their declared and actual profiles, churn (Poisson leaves and joins), stragglers
- `engine`: one GEMM, event by event, dealt by `cleave.gemm.dealer.Dealer` (the PS's own dealing core)
- `plans`, `step`: plans over time and whole training steps; `simulate_step` for validation runs
- `workload`, `baselines`, `pipelines`: the baselines' cost and memory models
- `systems`, `report`, `plots`: one comparison (`cleave sim --json`) and the evaluation report
"""

from cleave.gemm.dealer import Policy
from cleave.sim.step import Simulation, simulate_step
from cleave.sim.systems import SYSTEMS, SimConfig, compare

__all__ = ["SYSTEMS", "Policy", "SimConfig", "Simulation", "compare", "simulate_step"]
