"""Device code: every kernel compiles for sm_90 (offline), the fp8 fast paths, bounded waits in wall time."""
