"""The approximate methods' pure math (no NATS): DiLoCo, FedAvg with LoRA and robust aggregation, split learning.

Each module is a strategy the services drive over the bus: the PS side and the worker side of one round
or step, testable in one process against `cleave.train.trainer.Trainer`.
"""
