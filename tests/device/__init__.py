"""Device primitives: bounded waits in wall time."""
