"""The backends: registry-level checks, and one folder per backend."""
