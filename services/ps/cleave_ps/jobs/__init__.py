"""A PS job from start to end: the lifecycle every method shares and the drivers of pretraining, rounds
(DiLoCo, FedAvg) and split learning, and the replica group of a job trained by several PS."""
