"""Who takes part and with which blocks: device profiles and fleets, the cost model, the packing of blocks,
the planner, and the partition of a fleet among PS replicas."""
