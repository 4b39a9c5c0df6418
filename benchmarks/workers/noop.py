"""A worker that does nothing (the start-up measurements and the launchers' probes)."""
