"""A GEMM cut into tiles and dealt: tile math, the tiled autograd of the PS's linear layers, the ledger of
every tile's attempts, fan-out of shared strips, the dealer (who gets which tile next) and the same dealer
on virtual time (the engine the simulator and the step prediction run)."""
