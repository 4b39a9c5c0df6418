"""A group of workers, decided: ranks and environment, output, liveness, placement and kept
state."""
